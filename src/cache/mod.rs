//! The result cache: chosen reads answered from memory, without a server, with the exact bytes
//! PostgreSQL sent for them; invalidated by the writes pgmemo sees (read-your-writes).
//!
//! - What: `[[cache.rules]]` and `/* pgmemo cache */` hints ([`crate::config::cache`],
//!   [`crate::query::hint`]) pick simple queries by their normalized text (the lexer's:
//!   literals as `$n`, comments dropped). PostgreSQL's parser then says, once per shape, whether the query can be cached
//!   at all and what it reads ([`analysis`]); the catalog, once per shape and search_path,
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

mod admission;
pub mod auto;
pub mod catalog;
pub mod columns;
mod key;
pub mod own_commits;
pub mod rows;
pub mod versions;

use crate::config::cache::CacheConfig;
use crate::protocol::backend as be;
use crate::query::analysis::{self, Analysis, Bypass, Flush, BYPASS_REASONS};
use crate::query::hint;
use crate::query::lexer::{self, Lexed};
use crate::query::shapes::{ShapeStats, Shapes};
use crate::query::Reader;
use admission::Admission;
use arc_swap::ArcSwap;
use bytes::{Bytes, BytesMut};
use catalog::Snapshot;
use key::{Key, KeyIsHash, KeyRef};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use versions::{Seen, Versions};

/// Texts longer than this are not analyzed for their writes: they invalidate their database.
const MAX_ANALYZED_TEXT: usize = 64 * 1024;

/// A client's reused buffer (a fill's reply, its key, the first tier's key) that grew past
/// this for one long text is dropped rather than kept for every idle client.
const MAX_KEPT_BUFFER: usize = 64 * 1024;

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

#[derive(Clone)]
struct EntryWeight;

impl quick_cache::Weighter<Key, Arc<Entry>> for EntryWeight {
    fn weight(&self, key: &Key, value: &Arc<Entry>) -> u64 {
        // The key and reply bytes, and the entry's own bookkeeping.
        // The entry, its Arc and Box headers, the store's slot and the allocator's rounding
        // come to about 320 bytes besides the key and reply (measured against RSS).
        (key.len() + value.reply.len() + 320 + 16 * value.seen.slots.len()) as u64
    }
}

/// Counts evictions per rule, and tells admission that the store is full: that it evicted an
/// entry still good for its TTL to make room. (An expired entry stays in the store until a
/// lookup finds it or the store evicts it: evicting it is making room, not being full.)
#[derive(Clone)]
struct Evictions {
    full: Arc<AtomicBool>,
}

impl quick_cache::Lifecycle<Key, Arc<Entry>> for Evictions {
    type RequestState = ();

    fn on_evict(&self, _: &mut (), _: Key, value: Arc<Entry>) {
        value.rule.evictions.fetch_add(1, Relaxed);
        if !self.full.load(Relaxed) && value.expires > Instant::now() {
            self.full.store(true, Relaxed);
        }
    }
}

type Store = quick_cache::sync::Cache<Key, Arc<Entry>, EntryWeight, KeyIsHash, Evictions>;

/// A query being fetched for the cache by one client; others missing on its key wait for it.
#[derive(Default)]
pub struct Flight {
    done: tokio::sync::Notify,
    finished: AtomicBool,
    /// Clients that waited for it: their interest admits the result to the store.
    waiters: AtomicU64,
}

impl Flight {
    /// Waits until the fetch ends (stored or not), at most `limit`; false if it did not.
    pub async fn wait(&self, limit: Duration) -> bool {
        // SeqCst with `finish`: either it sees this waiter, or this sees it finished.
        self.waiters.fetch_add(1, SeqCst);
        let notified = self.done.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if self.finished.load(SeqCst) {
            return true;
        }
        tokio::time::timeout(limit, notified).await.is_ok()
    }

    fn finish(&self) {
        self.finished.store(true, SeqCst);
        // Most fetches have nobody waiting: no lock in Notify then.
        if self.waiters.load(SeqCst) > 0 {
            self.done.notify_waiters();
        }
    }
}

/// Fetches in progress, by the hash of their key (two keys with one hash only make a client
/// wait for a fetch that is not its own, then look up again), in shards with a lock each. A
/// miss inserts and its end removes microseconds later: papaya (lock-free) allocated a node
/// per insert and reclaimed it by epochs, and grew and copied its table under the churn,
/// ~700 instructions per miss; a shard's lock is uncontended (a one-thread runtime by
/// default, and 64 shards otherwise) and its small table allocates nothing once grown.
struct Flights {
    shards: Box<[parking_lot::Mutex<FlightShard>]>,
}

/// The keys are already hashes (foldhash of the key): used as they are.
type FlightShard = std::collections::HashMap<u64, Arc<Flight>, KeyIsHash>;

const FLIGHT_SHARDS: usize = 64;

impl Flights {
    fn new() -> Flights {
        Flights {
            shards: (0..FLIGHT_SHARDS)
                .map(|_| parking_lot::Mutex::new(FlightShard::default()))
                .collect(),
        }
    }

    fn shard(&self, key_hash: u64) -> &parking_lot::Mutex<FlightShard> {
        // Middle bits: the shard's table uses the low bits for the bucket and the top ones
        // for its tags.
        &self.shards[(key_hash >> 32) as usize % FLIGHT_SHARDS]
    }

    /// Registers `flight` for `key_hash`, or returns the fetch already running for it.
    fn start(&self, key_hash: u64, flight: &Arc<Flight>) -> Result<(), Arc<Flight>> {
        match self.shard(key_hash).lock().entry(key_hash) {
            std::collections::hash_map::Entry::Occupied(running) => Err(running.get().clone()),
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(flight.clone());
                Ok(())
            }
        }
    }

    /// Forgets `flight` if it is still the one registered for `key_hash`.
    fn end(&self, key_hash: u64, flight: &Arc<Flight>) {
        let mut shard = self.shard(key_hash).lock();
        if shard.get(&key_hash).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            shard.remove(&key_hash);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }
}

/// A simple query's shape (see [`crate::query::shapes`]): what the cache decides for a
/// query is derived once per shape and kept there.
pub use crate::query::shapes::Shape;

/// Which tables a cacheable shape reads under one search_path, or why it is not cacheable.
struct Plan {
    /// The database's catalog version it was resolved at.
    catalog: u64,
    /// Database slot first, then the tables' (a point read's: its table's unknown-rows
    /// slot; its rows' are added per execution).
    slots: Result<Box<[u32]>, Bypass>,
    tables: Arc<[Box<str>]>,
    /// A read of rows its key names (see [`rows`]).
    point: Option<rows::PointPlan>,
    /// A read by column (see [`columns`]): its equalities on columns whose values are
    /// followed (their slots are added per execution). None: not read by column.
    filters: Option<Vec<columns::ValueFilter>>,
    /// The tables whose rows its results hold by key (see [`columns::HeldRows`]).
    held: Box<[columns::HeldRows]>,
    /// Whether it returns at most one row whatever the data (see [`rows::OneRow`]).
    one_row: rows::OneRow,
    /// The text it was resolved for: compared on lookup (the map is keyed by hashes, and
    /// two texts whose hashes collide must not share their tables), and shown in `SHOW
    /// CACHE ENTRIES`.
    text: Arc<str>,
}

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

/// A catalog read the cache needs before it can decide.
pub struct Resolve {
    /// Run first when the database's snapshot is missing or stale.
    pub snapshot: bool,
    /// Resolves the query's relations.
    pub sql: String,
    database: Box<str>,
    plan_key: (u64, u64),
    text: Arc<str>,
    analysis: Arc<Analysis>,
    catalog: u64,
}

impl Resolve {
    pub const SNAPSHOT_SQL: &'static str = catalog::SNAPSHOT_SQL;
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

    pub fn enabled(&self) -> bool {
        self.enabled.load(Relaxed)
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

    /// Calls `f` with the current catalog snapshot of `database` (what writes are known by:
    /// tables' row keys, see [`rows`], and columns, see [`columns`]); None: not known yet, or
    /// older than the database's last DDL.
    pub fn with_snapshot<R>(&self, database: &str, f: impl FnOnce(Option<&Snapshot>) -> R) -> R {
        let snapshots = self.snapshots.pin();
        f(snapshots
            .get(database)
            .map(|s| &**s)
            .filter(|s| self.is_current(s, database)))
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

    /// Everything cached becomes stale (entries go lazily, at lookup or eviction).
    fn invalidate_all(&self) {
        self.flushes.fetch_add(1, Relaxed);
        self.versions.bump_all();
    }

    /// Everything cached for `database`, and what pgmemo knows of its catalog, becomes stale.
    fn invalidate_database(&self, database: &str) {
        self.flushes.fetch_add(1, Relaxed);
        self.versions.bump(catalog_slot(&self.versions, database));
        self.versions.bump_database(database);
    }

    /// The slots of `database` as a whole and of its catalog, which every result and plan of
    /// it depends on.
    pub fn database_slots(&self, database: &str) -> [u32; 2] {
        [
            catalog_slot(&self.versions, database),
            self.versions.database_slot(database),
        ]
    }

    /// `CACHE FLUSH`: everything, one database's entries, or what read one table.
    pub fn flush(&self, what: FlushTarget<'_>) {
        match what {
            FlushTarget::All => {
                self.invalidate_all();
                self.store.clear();
                self.raw.clear();
            }
            FlushTarget::Database(db) => {
                self.invalidate_database(db);
                self.store.retain(|_, e| &*e.database != db);
            }
            FlushTarget::Table(db, table) => {
                self.flushes.fetch_add(1, Relaxed);
                self.versions.bump_table(db, table);
                self.store
                    .retain(|_, e| &*e.database != db || !e.tables.iter().any(|t| &**t == table));
            }
        }
        self.admission.shrunk();
    }

    /// The shape of a text, with what was derived for it (once per shape): the lexer's shape
    /// when it read the text, else the text itself. None when it is too long to analyze or
    /// not UTF-8.
    fn shape(&self, sql: &[u8], reader: &mut Reader) -> Option<Arc<Shape>> {
        let shape = match reader.shape(sql, &self.shapes) {
            Ok((lexed, shape)) => {
                shape.derived(sql, &lexed.literals);
                shape.clone()
            }
            Err(_) if sql.len() <= MAX_ANALYZED_TEXT => {
                let shape = self.shapes.raw(sql);
                shape.stats.calls.fetch_add(1, Relaxed);
                shape.derived(sql, &[]);
                shape
            }
            Err(_) => return None,
        };
        shape.analysis()?;
        Some(shape)
    }

    /// The first tier: the entry stored for exactly this text in the client's context, if
    /// it is still valid and its rule (or hints) still chooses it. The caller has checked
    /// that the client may be answered from the cache now (idle, or `in_block`: in a READ
    /// COMMITTED block that has run nothing on a server; context current, caching not off,
    /// the WAL caught up).
    pub fn raw_hit(
        &self,
        client: &mut ClientCache,
        sql: &[u8],
        in_block: bool,
    ) -> Option<Arc<Entry>> {
        client.raw_key_valid = false;
        if client.caching_off()
            || client.temp
            || client.nonstandard_strings
            || client.context_of.is_none()
        {
            return None;
        }
        raw_key(&mut client.raw_key, &client.context, sql);
        let probe = client.first_tier_misses.probe();
        let entry = probe.then(|| self.raw.get(&client.raw_key[..])).flatten();
        if client.raw_key.capacity() > MAX_KEPT_BUFFER {
            // Not kept, so not remembered either.
            client.raw_key = Vec::new();
        } else {
            // Learnt at a second-tier hit even when not probed.
            client.raw_key_valid = true;
        }
        let entry = entry?.upgrade()?;
        let now = Instant::now();
        // A refresh due is claimed in the second tier (see `decide`).
        if entry.expires <= now || entry.refresh_due(now) || !self.versions.unchanged(&entry.seen) {
            return None;
        }
        if !entry.rule.chooses.load(Relaxed) || (in_block && !entry.rule.in_blocks.load(Relaxed)) {
            return None;
        }
        client.first_tier_misses = FirstTierMisses::default();
        entry.hits.fetch_add(1, Relaxed);
        entry.rule.hits.add(1);
        if let Some(shape) = &entry.shape {
            shape.stats.cache_figures().raw_hits.add(1);
        }
        Some(entry)
    }

    /// After a hit in the second tier on the Query whose first-tier lookup just missed
    /// ([`ResultCache::raw_hit`]): its text answers from the first tier from now on. (Done at
    /// a hit, not when the entry is stored: most entries of a workload with a low hit ratio
    /// are never read, and the first tier's insert and eviction would cost every store.)
    pub fn remember_raw(&self, client: &mut ClientCache, entry: &Arc<Entry>) {
        if std::mem::take(&mut client.raw_key_valid) {
            self.raw
                .insert(client.raw_key[..].into(), Arc::downgrade(entry));
        }
    }

    /// Notes what a Query the client sent may change (see [`ClientCache::settle`]); returns
    /// what was decided for its text, for [`ResultCache::lookup`].
    pub fn note_query(
        &self,
        client: &mut ClientCache,
        sql: &[u8],
        reader: &mut Reader,
    ) -> Option<Arc<Shape>> {
        if client.nonstandard_strings {
            // Read by the lexers as the server would not: what it writes is not known, and
            // it is not cached.
            client.note(&FLUSH_DATABASE);
            self.count(Bypass::NonstandardStrings);
            return None;
        }
        let shape = self.shape(sql, reader);
        match shape.as_ref().and_then(|s| Some((s, s.analysis()?))) {
            Some((shape, analysis)) => {
                let values = match reader.lexed() {
                    Some(lexed) if !shape.is_raw() => rows::Values::Lexed(lexed),
                    _ => rows::Values::None,
                };
                self.note(client, analysis, &values)
            }
            None => client.note(&FLUSH_DATABASE),
        }
        shape
    }

    /// Notes a message whose writes are not known (a FunctionCall): all of the database's
    /// results may change.
    pub fn note_unknown_write(&self, client: &mut ClientCache) {
        client.note(&FLUSH_DATABASE);
    }

    /// Notes what executing a statement (bound by `bind`) may change.
    pub fn note_statement(
        &self,
        client: &mut ClientCache,
        statement: &crate::statements::Statement,
        bind: &crate::protocol::frontend::Bind<'_>,
    ) {
        let values = rows::Values::Bind {
            rest: bind.rest,
            types: &statement.key.param_types,
        };
        self.note(client, statement_analysis(statement), &values);
    }

    /// Notes `analysis`, and a write to all of the database's results when reading what it
    /// names may write (the catalog's [`Snapshot::reading_may_write`]). A snapshot older than
    /// the database's catalog has nothing to say: the DDL since flushed the database, and no
    /// result of it is stored before the snapshot is read again.
    fn note(&self, client: &mut ClientCache, analysis: &Arc<Analysis>, values: &rows::Values<'_>) {
        client.note(analysis);
        if let Some(write) = &analysis.effects.rows {
            self.note_rows(client, write, values);
        }
        let reads = &analysis.effects.reads;
        // One load on the common path: no database read yet has a view or policy that writes.
        if reads.is_empty() || !self.reading_writes.load(Relaxed) {
            return;
        }
        let snapshots = self.snapshots.pin();
        let writes = snapshots
            .get(&*client.database)
            .is_some_and(|s| self.is_current(s, &client.database) && s.reading_may_write(reads));
        if writes {
            client.note(&FLUSH_DATA);
        }
    }

    /// Notes the rows `write` writes in this execution (`values`), or, when its text does not
    /// name them all by its table's row key, that its table's rows are not known (see
    /// [`rows`]).
    fn note_rows(
        &self,
        client: &mut ClientCache,
        write: &crate::query::point::RowWrite,
        values: &rows::Values<'_>,
    ) {
        if client.pending_rows.len() > MAX_PENDING_ROWS {
            // A long transaction of row writes: all of the database's data instead.
            client.pending_rows.clear();
            client.note(&FLUSH_DATA);
        }
        let (database, pending) = (&*client.database, &mut client.pending_rows);
        self.with_snapshot(database, |snapshot| {
            let table = &*write.table;
            let before = pending.len();
            let named = snapshot.and_then(|s| s.row_key(table)).is_some_and(|key| {
                rows::push_write_slots(write, key, &self.versions, database, values, pending)
            });
            let figures = &self.row_figures;
            if named {
                let n = pending.len() - before;
                figures.rows_bumped.fetch_add(n as u64, Relaxed);
            } else {
                pending.push(self.versions.unknown_rows_slot(database, table));
                figures.unknown_rows.fetch_add(1, Relaxed);
            }
            let of = snapshot.and_then(|s| s.table_columns(table));
            columns::push_write(write, of, &self.versions, database, values, pending)
        });
    }

    /// Looks up a simple query whose text `sql` was just noted (`shape`; `reader`, the
    /// session's reading of it). `may_wait`: whether waiting for another client's fetch is
    /// still allowed (once per query).
    pub fn lookup(
        &self,
        client: &mut ClientCache,
        at: &Where<'_>,
        sql: &[u8],
        reader: &Reader,
        shape: &Arc<Shape>,
        may_wait: bool,
    ) -> Lookup {
        let (Some(lexed), Some(analysis)) = (reader.lexed(), shape.analysis()) else {
            return Lookup::Pass;
        };
        client.build_key(lexed);
        let hints = client.hint.read(sql, &lexed.comment_spans);
        self.decide(
            client,
            at,
            Candidate {
                hints,
                hint_warned: &shape.hint_warned,
                text: &lexed.text,
                display: shape.display(),
                hash: lexed.shape,
                query_hash: shape.query_hash,
                analysis,
                extended: false,
                shape: Some(shape),
                values: rows::Values::Lexed(lexed),
                portal: Portal::Ended,
            },
            may_wait,
        )
    }

    /// Looks up an extended-protocol `batch` that runs `statement`: keyed by the statement
    /// (by its text and parameter types when it has comments, which are not part of the key:
    /// statements that differ only in a per-request comment share entries), whether the
    /// portal is described, the Execute's row limit and the Bind's formats, values and
    /// result formats.
    pub fn lookup_statement(
        &self,
        client: &mut ClientCache,
        at: &Where<'_>,
        statement: &crate::statements::Statement,
        batch: &Batch<'_>,
        may_wait: bool,
    ) -> Lookup {
        let analysis = statement_analysis(statement);
        client.key.clear();
        client.key.extend_from_slice(&client.context);
        match &statement.cache_text {
            None => {
                client.key.push(b'E');
                client.key.extend_from_slice(&statement.id.to_le_bytes());
            }
            Some(text) => {
                client.key.push(b'e');
                let types = &statement.key.param_types;
                for part in [&text[..], &types[..]] {
                    client
                        .key
                        .extend_from_slice(&(part.len() as u32).to_le_bytes());
                    client.key.extend_from_slice(part);
                }
            }
        }
        client.key.push(u8::from(batch.describe));
        client.key.extend_from_slice(&batch.max_rows.to_le_bytes());
        client.key.extend_from_slice(batch.bind.rest);
        let hash = lexer::hasher().hash_one(&statement.key.query[..]) ^ 1;
        let shape = statement.shape(&self.shapes);
        let looked_up = self.decide(
            client,
            at,
            Candidate {
                hints: *statement
                    .cache_hints
                    .get_or_init(|| hint::read_statement(&statement.key.query)),
                hint_warned: &statement.hint_warned,
                text: &statement.key.query,
                display: None,
                hash,
                query_hash: shape.map_or(hash, |s| s.query_hash),
                analysis,
                extended: true,
                shape,
                values: rows::Values::Bind {
                    rest: batch.bind.rest,
                    types: &statement.key.param_types,
                },
                portal: if !batch.bind.portal.is_empty() {
                    Portal::Named
                } else if batch.max_rows != 0 {
                    Portal::Limited
                } else {
                    Portal::Ended
                },
            },
            may_wait,
        );
        if let (Lookup::Hit(_), Some(shape)) = (&looked_up, shape) {
            // A call the server never sees (the planner counts the others).
            shape.stats.calls.fetch_add(1, Relaxed);
        }
        looked_up
    }

    /// What `query`'s comments ask, once a malformed hint among them is counted and logged
    /// (it is ignored).
    fn hint(&self, query: &Candidate<'_>) -> Option<hint::Hint> {
        if let Some(why) = query.hints.malformed {
            self.count(Bypass::MalformedHint);
            hint::warn_once(query.hint_warned, why, query.text);
        }
        query.hints.hint
    }

    /// What chooses `query` for caching, with whose counters: its hint (`nocache` counted
    /// as a bypass), else the first rule that matches it. None: nothing does.
    fn choose<'r>(
        &self,
        cfg: &CacheConfig,
        rules: &'r [Arc<RuleStats>],
        hint: Option<hint::Hint>,
        at: &Where<'_>,
        query: &Candidate<'_>,
    ) -> Option<(Chosen, usize, &'r Arc<RuleStats>)> {
        match hint {
            Some(hint::Hint::NoCache) => {
                self.count(Bypass::Hint);
                None
            }
            Some(hint::Hint::Cache { ttl }) => Some((
                Chosen::by_section(cfg, ttl.unwrap_or(cfg.default_ttl)),
                cfg.rules.len(),
                rules.get(cfg.rules.len())?,
            )),
            None => {
                // Rules match the text as a string; a hint needs none of it.
                let text = std::str::from_utf8(query.text).unwrap_or_default();
                let found = cfg
                    .rules
                    .iter()
                    .position(|r| r.matches(at.name, at.user, text, query.query_hash));
                let Some(i) = found else {
                    // Else auto mode's choice (see `auto`), after the rules.
                    let chosen = cfg.mode == crate::config::cache::CacheMode::Auto
                        && query.shape.is_some_and(|s| auto::chosen(s));
                    if !chosen {
                        return None;
                    }
                    let place = cfg.rules.len() + 1;
                    return Some((
                        Chosen::by_section(cfg, cfg.default_ttl),
                        place,
                        rules.get(place)?,
                    ));
                };
                let r = &cfg.rules[i];
                Some((
                    Chosen {
                        ttl: r.ttl,
                        cache_empty: r.cache_empty,
                        max_result_bytes: r.max_result_bytes,
                        transactions: r.transactions,
                        refresh_at: r.refresh_at,
                    },
                    i,
                    rules.get(i)?,
                ))
            }
        }
    }

    /// Whether a rule or hint wants `query`, whether it may be cached, and whether its key
    /// (in `client.key`) is stored.
    fn decide(
        &self,
        client: &mut ClientCache,
        at: &Where<'_>,
        query: Candidate<'_>,
        may_wait: bool,
    ) -> Lookup {
        let generation = self.generation.load(std::sync::atomic::Ordering::Acquire);
        if client.settings.as_ref().is_none_or(|s| s.0 != generation) {
            client.settings = Some((generation, self.config.load_full(), self.rules.load_full()));
        }
        let Some((_, cfg, rules)) = &client.settings else {
            return Lookup::Pass;
        };
        let hint = if cfg.hints { self.hint(&query) } else { None };
        let Some((rule, place, stats)) = self.choose(cfg, rules, hint, at, &query) else {
            return Lookup::Pass;
        };
        let figures = query.shape.map(|s| &s.stats);
        if let Some(f) = figures {
            ShapeStats::note(&f.chosen, (place + 1).min(u16::MAX as usize) as u16);
        }
        let bypass = |why: Bypass| {
            self.count(why);
            stats.bypasses.add(1);
            if let Some(f) = figures {
                ShapeStats::note(&f.bypass, (why.index() + 1) as u16);
            }
            Lookup::Pass
        };
        if let Some(why) = client.not_served() {
            return bypass(why);
        }
        // A read before the block's isolation is asked (the question takes a snapshot).
        let reads = match &query.analysis.read {
            Ok(reads) => reads,
            Err(why) => return bypass(*why),
        };
        let in_block = match in_block(at, &rule, query.portal) {
            Ok(in_block) => in_block,
            Err(Some(why)) => return bypass(why),
            Err(None) => return Lookup::Isolation,
        };
        if at.wal_behind {
            return bypass(Bypass::WalBehind);
        }
        let plan = match self.plan_or_resolve(client, at, &query, reads) {
            Ok(plan) => plan,
            Err(resolve) => return Lookup::Resolve(resolve),
        };
        if let Err(why) = &plan.slots {
            return bypass(*why);
        }
        if in_block {
            if let Some(why) = self.not_in_this_block(at, client, &query, &plan) {
                return bypass(why);
            }
        }
        let key = KeyRef::new(&client.key);
        let refresh = match self.stored(&key, &mut client.spares, stats, may_wait) {
            Stored::Valid(entry) => {
                // Not run: the read (whose functions the plan found harmless) writes nothing.
                if client
                    .pending
                    .last()
                    .is_some_and(|p| Arc::ptr_eq(p, query.analysis))
                {
                    client.pending.pop();
                }
                return hit(entry, stats, figures);
            }
            Stored::Refresh => true,
            Stored::Absent => false,
        };
        let key_hash = key.hash;
        let flight = client.spares.flight.take().unwrap_or_default();
        if refresh {
            // Its flight started with the claim.
            stats.refreshes.fetch_add(1, Relaxed);
        } else if let Err(running) = self.flights.start(key_hash, &flight) {
            client.spares.flight = Some(flight);
            return if may_wait {
                Lookup::Wait(running)
            } else {
                // Waited once already: run it without filling.
                Lookup::Pass
            };
        } else {
            stats.misses.add(1);
            if let Some(f) = figures {
                ShapeStats::note(&f.bypass, 0);
                f.cache_figures().misses.add(1);
            }
        }
        // A refresh is stored whatever the admission says: its key is read.
        let admit_after = if refresh { 1 } else { cfg.admit_after };
        self.start_fill(
            client,
            admit_after,
            (at.database, &query.values),
            Miss {
                key_hash,
                flight,
                chosen: rule,
                // A reference taken for a fill only: on a hit, taking one would write a count
                // that every worker's hits write.
                stats: stats.clone(),
                plan,
                extended: query.extended,
                in_block,
                shape: query.shape.cloned(),
            },
        );
        Lookup::Miss
    }

    /// Why a read in a READ COMMITTED block may not be answered there: the block wrote what
    /// it reads, or its Execute's row limit may leave rows in its portal (see [`Portal`]).
    fn not_in_this_block(
        &self,
        at: &Where<'_>,
        client: &ClientCache,
        query: &Candidate<'_>,
        plan: &Plan,
    ) -> Option<Bypass> {
        if self.block_wrote(at.database, &client.pending, query.analysis, &plan.tables) {
            return Some(Bypass::WrittenInTransaction);
        }
        let types = match query.values {
            rows::Values::Bind { types, .. } => types,
            _ => &[],
        };
        (query.portal == Portal::Limited && !plan.one_row.holds(types))
            .then_some(Bypass::RowLimitInBlock)
    }

    /// The entry stored for `key`: valid, valid but to be refreshed by this client (claimed,
    /// its flight started with `spares`' flight), or none (an invalid one is removed).
    fn stored(
        &self,
        key: &KeyRef<'_>,
        spares: &mut Spares,
        stats: &RuleStats,
        may_wait: bool,
    ) -> Stored {
        let Some(entry) = self.store.get(key) else {
            return Stored::Absent;
        };
        let now = Instant::now();
        if entry.expires <= now || !self.versions.unchanged(&entry.seen) {
            if self.store.remove(key).is_some() {
                stats.invalidations.fetch_add(1, Relaxed);
            }
            return Stored::Absent;
        }
        // A read late in its life refreshes it: this client's query runs (once, on one
        // client: it claims the entry) and the others keep getting hits meanwhile.
        if may_wait && entry.refresh_due(now) && !entry.refreshing.swap(true, Relaxed) {
            let flight = spares.flight.get_or_insert_default();
            if self.flights.start(key.hash, flight).is_ok() {
                return Stored::Refresh;
            }
            entry.refreshing.store(false, Relaxed);
        }
        Stored::Valid(entry)
    }

    /// The plan of `query` (its relations resolved for the client's search_path) at the
    /// database's current catalog version, or the catalog read that makes it.
    fn plan_or_resolve(
        &self,
        client: &ClientCache,
        at: &Where<'_>,
        query: &Candidate<'_>,
        reads: &analysis::Reads,
    ) -> Result<Arc<Plan>, Box<Resolve>> {
        let plan_key = (query.hash, client.path_hash);
        let catalog = self.versions.get(catalog_slot(&self.versions, at.database));
        if let Some(plan) = self.current_plan(plan_key, catalog, query.text) {
            return Ok(plan);
        }
        let snapshot = self
            .snapshots
            .pin()
            .get(at.database)
            .is_none_or(|s| s.generation != catalog);
        // The text, as a string, when the shape has no display text of its own.
        let text = || std::str::from_utf8(query.text).unwrap_or_default().into();
        Err(Box::new(Resolve {
            snapshot,
            sql: catalog::resolve_sql(reads, client.search_path.as_deref()),
            database: at.database.into(),
            plan_key,
            text: query.display.cloned().unwrap_or_else(text),
            analysis: query.analysis.clone(),
            catalog,
        }))
    }

    /// Opens the client's fill for a miss (its key in `client.key`), whose flight started:
    /// the result is captured from the replies and stored at their ReadyForQuery.
    fn start_fill(
        &self,
        client: &mut ClientCache,
        admit_after: u32,
        (database, values): (&str, &rows::Values<'_>),
        miss: Miss,
    ) {
        let Miss {
            key_hash,
            flight,
            chosen,
            stats,
            plan,
            extended,
            in_block,
            shape,
        } = miss;
        let admitted = admit_after <= 1 || self.admission.admits(key_hash, &self.store);
        // The key goes into the buffer of the client's last fill: copied out only if stored.
        let mut key = std::mem::take(&mut client.spares.key);
        key.clear();
        key.extend_from_slice(&client.key);
        let mut slots = std::mem::take(&mut client.slots);
        slots.clear();
        slots.extend_from_slice(plan.slots.as_deref().unwrap_or_default());
        if let Some(point) = &plan.point {
            let figures = &self.row_figures;
            if point.push_slots(&self.versions, database, values, &mut slots) {
                figures.point_fills.fetch_add(1, Relaxed);
            } else {
                // Its values name no row: it depends on every write to its table.
                let unknown = self.versions.unknown_rows_slot(database, &point.table);
                for slot in slots.iter_mut().filter(|s| **s == unknown) {
                    *slot = self.versions.table_slot(database, &point.table);
                }
                figures.point_fallbacks.fetch_add(1, Relaxed);
            }
        }
        if let Some(filters) = &plan.filters {
            let figures = &self.row_figures;
            figures.column_fills.fetch_add(1, Relaxed);
            let fallbacks =
                columns::push_value_slots(filters, &self.versions, database, values, &mut slots);
            figures.value_fallbacks.fetch_add(fallbacks, Relaxed);
        }
        let seen = self
            .versions
            .capture(&slots, std::mem::take(&mut client.spares.seen));
        client.slots = slots;
        client.fill = Some(Fill {
            key,
            key_hash,
            admitted,
            flight: Some((
                flight,
                client
                    .spares
                    .flights
                    .take()
                    .unwrap_or_else(|| self.flights.clone()),
            )),
            seen,
            chosen,
            stats,
            plan,
            database: client.database.clone(),
            reply: std::mem::take(&mut client.spares.reply),
            rows: false,
            spoiled: None,
            extended,
            in_block,
            shape,
        });
    }

    /// The plan resolved for `text` (its hash and search_path in `plan_key`) at the
    /// database's catalog version `catalog`.
    fn current_plan(&self, plan_key: (u64, u64), catalog: u64, text: &[u8]) -> Option<Arc<Plan>> {
        self.plans
            .get(&plan_key)
            .filter(|plan| plan.catalog == catalog && plan.text.as_bytes() == text)
    }

    /// Takes in what a [`Resolve`] read (`Err`: it could not be read, counted and not
    /// remembered: tried again next time). Returns whether it could be read.
    pub fn resolved(
        &self,
        job: Resolve,
        snapshot_rows: Option<&[Vec<Option<String>>]>,
        rows: Result<&[Vec<Option<String>>], ()>,
    ) -> bool {
        if rows.is_err() || (job.snapshot && snapshot_rows.is_none()) {
            self.count(Bypass::CatalogUnavailable);
            return false;
        }
        if let Some(rows) = snapshot_rows {
            let snapshot = Snapshot::from_rows(job.catalog, rows);
            if snapshot.has_reading_writes() {
                self.reading_writes.store(true, Relaxed);
            }
            self.snapshots
                .pin()
                .insert(job.database.clone(), Arc::new(snapshot));
        }
        let snapshots = self.snapshots.pin();
        let snapshot = snapshots.get(&job.database);
        let reads = job.analysis.read.as_ref().ok();
        let tables: Result<Vec<Box<str>>, Bypass> = match (rows, snapshot, reads) {
            (Ok(rows), Some(snapshot), Some(reads)) if snapshot.generation == job.catalog => {
                catalog::resolved(reads, rows, snapshot)
            }
            _ => Err(Bypass::CatalogUnavailable),
        };
        let point = match (
            &tables,
            reads.and_then(|r| r.filter.as_ref()),
            snapshot,
            rows,
        ) {
            (Ok(tables), Some(filter), Some(snapshot), Ok(rows)) => {
                catalog::point_plan(filter, tables, rows, snapshot)
            }
            _ => None,
        };
        // A read not of rows by key may be read column by column (see [`columns`]).
        let by_column = match (
            &tables,
            reads.and_then(|r| r.columns.as_ref()),
            snapshot,
            rows,
        ) {
            (Ok(tables), Some(reads), Some(snapshot), Ok(rows)) if point.is_none() => {
                columns::plan(
                    reads,
                    tables,
                    rows,
                    snapshot,
                    (&self.versions, &job.database),
                )
            }
            _ => None,
        };
        let (column_slots, filters, held) = match by_column {
            Some(p) => (Some(p.slots), Some(p.filters), p.held.into()),
            None => (None, None, Box::default()),
        };
        let slots = tables.as_ref().map(|tables| {
            let table_slot = |t: &str| match point {
                Some(_) => self.versions.unknown_rows_slot(&job.database, t),
                None => self.versions.table_slot(&job.database, t),
            };
            let database = std::iter::once(self.versions.database_slot(&job.database));
            match column_slots {
                Some(slots) => database.chain(slots).collect::<Box<[u32]>>(),
                None => database
                    .chain(tables.iter().map(|t| table_slot(t)))
                    .collect(),
            }
        });
        let slots = slots.map_err(|e| *e);
        let one_row = match (&tables, reads, snapshot) {
            (Ok(tables), Some(reads), Some(snapshot)) => catalog::one_row(reads, tables, snapshot),
            _ => rows::OneRow::Never,
        };
        self.plans.insert(
            job.plan_key,
            Arc::new(Plan {
                catalog: job.catalog,
                slots,
                tables: tables.unwrap_or_default().into(),
                point,
                filters,
                held,
                one_row,
                text: job.text,
            }),
        );
        true
    }

    /// Stores a finished fill (see [`ClientCache::capture`]) if it may be; gives its buffers
    /// (reply, key) and its flight back for the client's next fill.
    fn store_fill(&self, mut fill: Fill, status: u8) -> Spares {
        // Read before the versions it was sent with are compared: a write to a row it holds
        // bumps the column's version before the row's (see `Versions::bump_slots`).
        let held = self.held_rows(&fill);
        let admitted = fill.admitted
            || fill
                .flight
                .as_ref()
                .is_some_and(|(f, _)| f.waiters.load(Relaxed) > 0);
        let why = if let Some(why) = fill.spoiled {
            Some(why)
        } else if status != b'I' && !(status == b'T' && fill.in_block) {
            Some(Bypass::InTransaction)
        } else if !fill.rows && !fill.chosen.cache_empty {
            Some(Bypass::Empty)
        } else if !self.versions.unchanged(&fill.seen) {
            Some(Bypass::WrittenMeanwhile)
        } else if !admitted {
            Some(Bypass::FirstMiss)
        } else {
            None
        };
        match why {
            Some(why) => {
                self.count(why);
                fill.stats.bypasses.add(1);
            }
            None => {
                if let Some(held) = held {
                    let found = held.iter().filter(|h| h.is_some()).count() as u64;
                    self.row_figures.held_fills.fetch_add(found, Relaxed);
                    fill.seen.slots = held_dependencies(&fill.plan.held, &fill.seen.slots, held);
                }
                let now = Instant::now();
                let entry = Entry {
                    // Exactly its size (the buffer is reused for the client's next fill).
                    reply: Bytes::copy_from_slice(&fill.reply),
                    expires: now + fill.chosen.ttl,
                    refresh_at: now + fill.chosen.ttl.mul_f64(fill.chosen.refresh_at),
                    refreshing: AtomicBool::new(false),
                    seen: std::mem::take(&mut fill.seen),
                    rule: fill.stats.clone(),
                    text: fill.plan.text.clone(),
                    tables: fill.plan.tables.clone(),
                    database: fill.database.clone(),
                    hits: AtomicU64::new(0),
                    shape: fill.shape.clone(),
                };
                fill.stats.stores.fetch_add(1, Relaxed);
                let entry = Arc::new(entry);
                self.store
                    .insert(Key::with_hash(fill.key_hash, fill.key[..].into()), entry);
            }
        }
        let mut spare = std::mem::take(&mut fill.reply);
        spare.clear();
        if spare.capacity() > MAX_KEPT_BUFFER {
            spare = BytesMut::new();
        }
        let mut key = std::mem::take(&mut fill.key);
        if key.capacity() > MAX_KEPT_BUFFER {
            key = Vec::new();
        }
        let (flight, flights) = fill.end_flight();
        Spares {
            reply: spare,
            key,
            seen: std::mem::take(&mut fill.seen),
            flight,
            flights,
        }
    }

    /// The rows each of the fill's held tables (see [`columns::HeldRows`]) its result holds,
    /// with their versions now: per table, None when they are not known (it then depends on
    /// the columns it shows).
    fn held_rows(&self, fill: &Fill) -> Option<Vec<HeldVersions>> {
        if fill.plan.held.is_empty() || !fill.rows {
            return None;
        }
        let mut slots = Vec::new();
        let held = fill.plan.held.iter().map(|h| {
            slots.clear();
            columns::held_slots(h, &fill.reply, &self.versions, &fill.database, &mut slots)
                .then(|| slots.iter().map(|&s| (s, self.versions.get(s))).collect())
        });
        Some(held.collect())
    }

    /// Whether `snapshot` of `database` was read at the database's current catalog version
    /// (one older than the last DDL is not trusted).
    fn is_current(&self, snapshot: &Snapshot, database: &str) -> bool {
        snapshot.generation == self.versions.get(catalog_slot(&self.versions, database))
    }

    /// Bumps what `effects` may have changed in `database`, and the slots of `rows` (see
    /// [`ClientCache::pending_rows`]).
    fn apply(&self, database: &str, effects: &[Arc<Analysis>], rows: &[u32]) {
        let reach = self.reach(database, effects, |table, by_row| {
            if by_row {
                // Its rows' slots (or its unknown-rows slot) are among `rows`.
                self.versions.bump_table_writes(database, table);
            } else {
                self.versions.bump_table(database, table);
            }
            false
        });
        self.versions.bump_slots(rows);
        match reach {
            Reach::Tables => {}
            // Data only: the catalog knowledge stays good.
            Reach::Data => {
                self.flushes.fetch_add(1, Relaxed);
                self.versions.bump_database(database);
            }
            Reach::Database => self.invalidate_database(database),
            Reach::All => self.invalidate_all(),
        }
    }

    /// Whether the statements of the client's open block (`pending`) may have written
    /// anything a result read through `slots` depends on: then the block reads its own
    /// writes there, which are nobody else's. `own`: the analysis of the read looked up,
    /// whose functions its plan found harmless (it writes nothing, wherever it ran before).
    fn block_wrote(
        &self,
        database: &str,
        pending: &[Arc<Analysis>],
        own: &Arc<Analysis>,
        tables: &[Box<str>],
    ) -> bool {
        if pending.iter().all(|p| Arc::ptr_eq(p, own)) {
            return false;
        }
        let mut wrote = false;
        let reach = self.reach(database, pending, |table, _| {
            wrote = tables.iter().any(|t| **t == *table);
            wrote
        });
        wrote || reach != Reach::Tables
    }

    /// What `effects` may have changed in `database`: each table a write reaches is passed to
    /// `table` (which returns true to stop early: the answer is then [`Reach::Tables`]), with
    /// whether the write is the one its rows were noted for (see [`ClientCache::pending_rows`]:
    /// the statement's own table, not what a write to it reaches), and the answer says
    /// whether more than those tables may have changed.
    fn reach(
        &self,
        database: &str,
        effects: &[Arc<Analysis>],
        mut table: impl FnMut(&str, bool) -> bool,
    ) -> Reach {
        let snapshots = self.snapshots.pin();
        let known = snapshots.get(database);
        let snapshot = known.filter(|s| self.is_current(s, database));
        // A snapshot older than the last DDL: triggers, cascades and functions may have
        // changed, so a write may reach anything. (No snapshot at all: nothing is cached for
        // the database yet beyond what its tables' own versions guard.)
        let stale = known.is_some() && snapshot.is_none();
        let mut whole = false;
        for a in effects {
            let e = &a.effects;
            match e.flush {
                Flush::All => return Reach::All,
                Flush::Database => return Reach::Database,
                Flush::Data => whole = true,
                Flush::None => {}
            }
            let by_row = |t: &str| e.rows.as_ref().is_some_and(|r| *r.table == *t);
            for written in &e.writes {
                match snapshot.map(|s| s.reached_by_write(written)) {
                    Some(Some(reached)) => {
                        let own = by_row(written);
                        if reached
                            .iter()
                            .enumerate()
                            .any(|(i, t)| table(t, own && i == 0))
                        {
                            return Reach::Tables;
                        }
                    }
                    // A table with triggers or rules.
                    Some(None) => whole = true,
                    None => {
                        if table(written, false) {
                            return Reach::Tables;
                        }
                        whole |= stale;
                    }
                }
            }
            match snapshot {
                Some(s) => whole |= e.calls.iter().any(|c| s.call_may_write(c)),
                None => whole |= stale && !e.calls.is_empty(),
            }
        }
        if whole {
            Reach::Data
        } else {
            Reach::Tables
        }
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

/// Whether a query chosen by `rule` (leaving `portal`) is looked up in a transaction block
/// (`Ok(true)`), outside one (`Ok(false)`), or not: `Err(Some(why))`, counted (a named
/// portal, which outlives the Sync in a block, among them); `Err(None)`: the block's isolation
/// must be asked first ([`Lookup::Isolation`]).
fn in_block(at: &Where<'_>, rule: &Chosen, portal: Portal) -> Result<bool, Option<Bypass>> {
    match at.transaction {
        Transaction::Idle => Ok(false),
        Transaction::Block { .. } if portal == Portal::Named => {
            Err(Some(Bypass::NamedPortalInBlock))
        }
        Transaction::Block { .. } if !rule.transactions => Err(Some(Bypass::InTransaction)),
        Transaction::Block { read_committed } => match read_committed {
            Some(true) => Ok(true),
            Some(false) => Err(Some(Bypass::Isolation)),
            None if at.wal_behind => Err(Some(Bypass::WalBehind)),
            None => Err(None),
        },
        Transaction::Busy => Err(Some(Bypass::InTransaction)),
    }
}

/// A miss whose fill starts (see [`ResultCache::start_fill`]).
struct Miss {
    key_hash: u64,
    flight: Arc<Flight>,
    chosen: Chosen,
    stats: Arc<RuleStats>,
    plan: Arc<Plan>,
    extended: bool,
    in_block: bool,
    shape: Option<Arc<Shape>>,
}

/// The slots of the rows one held table's result holds, with their versions; None: not
/// known.
type HeldVersions = Option<Vec<(u32, u64)>>;

/// A stored result's dependencies once the rows of its held tables are known (`rows`, per
/// table of `held`, with their versions): for each table whose rows are, its shown-only
/// columns' slots give way to its rows'; for each whose rows are not, the unknown-rows slot
/// the plan added for it goes.
fn held_dependencies(
    held: &[columns::HeldRows],
    seen: &[(u32, u64)],
    rows: Vec<HeldVersions>,
) -> Box<[(u32, u64)]> {
    let mut gone: Vec<u32> = Vec::new();
    let mut added: Vec<(u32, u64)> = Vec::new();
    for (h, rows) in held.iter().zip(rows) {
        match rows {
            Some(rows) => {
                gone.extend_from_slice(&h.shown_only);
                added.extend(rows);
            }
            None if h.unknown_rows_added => gone.push(h.unknown_rows),
            None => {}
        }
    }
    seen.iter()
        .filter(|(s, _)| !gone.contains(s))
        .copied()
        .chain(added)
        .collect()
}

/// Counts a hit on `entry` (chosen by the rule of `stats`; of a shape with `figures`).
#[inline]
fn hit(entry: Arc<Entry>, stats: &RuleStats, figures: Option<&ShapeStats>) -> Lookup {
    entry.hits.fetch_add(1, Relaxed);
    stats.hits.add(1);
    if let Some(f) = figures {
        ShapeStats::note(&f.bypass, 0);
        f.cache_figures().hits.add(1);
    }
    Lookup::Hit(entry)
}

/// What the store holds for a key (see [`ResultCache::stored`]).
enum Stored {
    Valid(Arc<Entry>),
    Refresh,
    Absent,
}

/// How far a set of writes reaches (see [`ResultCache::reach`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// The tables passed on, no more.
    Tables,
    /// Any data of the database (its catalog knowledge stays good).
    Data,
    /// Anything of the database.
    Database,
    /// Anything at all.
    All,
}

/// What was decided for a registry statement, made at its first use by the cache.
fn statement_analysis(statement: &crate::statements::Statement) -> &Arc<Analysis> {
    statement
        .cache_analysis
        .get_or_init(|| match std::str::from_utf8(&statement.key.query) {
            Ok(text) if text.len() <= MAX_ANALYZED_TEXT => Arc::new(analysis::analyze(text)),
            _ => FLUSH_DATABASE.clone(),
        })
}

/// A query the cache is asked about.
struct Candidate<'a> {
    /// What its comments ask (read from the client's text: the lexer's comments).
    hints: hint::Hints,
    /// Whether a malformed hint of its shape or statement was logged.
    hint_warned: &'a std::sync::atomic::AtomicBool,
    /// What rules match: the normalized text (simple queries) or the statement's text.
    text: &'a [u8],
    /// The same, shareable (for the entry), when it is at hand.
    display: Option<&'a Arc<str>>,
    /// Its plans' key (with the search_path's), apart for the two protocols.
    hash: u64,
    /// What a rule's `query_hash` matches: its shape's, the same for both protocols.
    query_hash: u64,
    analysis: &'a Arc<Analysis>,
    extended: bool,
    /// Its shape (a simple query's, or its statement's), whose figures (SHOW QUERIES) the
    /// decision adds to.
    shape: Option<&'a Arc<Shape>>,
    /// Its values (which rows a point read reads).
    values: rows::Values<'a>,
    /// What it leaves of its portal, which in a transaction block outlives the Sync.
    portal: Portal,
}

/// What a query leaves of its portal. In a transaction block the Sync does not close it: a
/// hit's is made again on the server if the client uses it (see
/// `Session::portal_left_by_hit`), which holds only for a portal run to its end.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Portal {
    /// None (a simple query), or the unnamed one run to its end.
    Ended,
    /// The unnamed one, run to a row limit: at its end only if the read returns at most one
    /// row (see [`rows::OneRow`]).
    Limited,
    /// A named one: not answered in a block.
    Named,
}

/// An extended-protocol batch the cache may answer without a server: `[Parse ""] Bind
/// [Describe portal] Execute Sync`, all of it already read. The Execute's row limit is part
/// of the key (asyncpg's `fetchrow` and `fetchval` ask for one row): its reply ends in
/// PortalSuspended when rows are left, which the Sync makes final, as it closes the portal
/// outside a transaction block. In a block the portal outlives the Sync: a row-limited batch
/// is answered there only for a read that returns at most one row (see [`Portal`]).
pub struct Batch<'a> {
    pub parse: Option<crate::protocol::frontend::Parse<'a>>,
    pub bind: crate::protocol::frontend::Bind<'a>,
    pub describe: bool,
    /// The Execute's row limit, 0 for all rows (PostgreSQL reads a negative one as 0).
    pub max_rows: i32,
    /// Bytes of the whole batch.
    pub len: usize,
}

/// Reads the batch at the start of `input`, if it is one the cache handles.
pub fn batch(input: &[u8]) -> Option<Batch<'_>> {
    use crate::protocol::frontend::{self as fe, Bind, Execute, Parse, Target};
    // A message not all there, or with an impossible length, ends the batch: the session's
    // own framing deals with it.
    let mut messages = crate::protocol::messages(input);
    let mut next = || messages.next();
    let (mut tag, mut body) = next()?;
    let mut parse = None;
    if tag == fe::PARSE {
        let p = Parse::parse(body)?;
        if !p.name.is_empty() {
            return None;
        }
        parse = Some(p);
        (tag, body) = next()?;
    }
    if tag != fe::BIND {
        return None;
    }
    let bind = Bind::parse(body)?;
    if parse.is_some() && !bind.statement.is_empty() {
        return None;
    }
    (tag, body) = next()?;
    let mut describe = false;
    if tag == fe::DESCRIBE {
        let d = Target::parse(body)?;
        if d.kind != b'P' || d.name != bind.portal {
            return None;
        }
        describe = true;
        (tag, body) = next()?;
    }
    if tag != fe::EXECUTE {
        return None;
    }
    let e = Execute::parse(body)?;
    if e.portal != bind.portal {
        return None;
    }
    let max_rows = e.max_rows.max(0);
    let (tag, body) = next()?;
    if tag != fe::SYNC || !body.is_empty() {
        return None;
    }
    Some(Batch {
        parse,
        bind,
        describe,
        max_rows,
        len: messages.at,
    })
}

/// The first tier's key of a simple query's text in a client's context, written to `key`.
fn raw_key(key: &mut Vec<u8>, context: &[u8], sql: &[u8]) {
    key.clear();
    key.extend_from_slice(context);
    key.push(0xff); // no UTF-8 text holds it: the context's end, unambiguously
    key.extend_from_slice(sql);
}

/// What a finished fill leaves for the client's next (no allocation per miss): its
/// buffers, and its flight when nobody else holds it any more.
#[derive(Default)]
struct Spares {
    reply: BytesMut,
    key: Vec<u8>,
    /// Empty when the fill was stored (its versions went to the entry).
    seen: Seen,
    flight: Option<Arc<Flight>>,
    /// The cache's flights, held by a fill to end its flight when it is dropped: passed from
    /// fill to fill, not cloned for each (a count written by every worker's misses).
    flights: Option<Arc<Flights>>,
}

/// A normalized query text without the `;` that may end it (and the blanks around): `SELECT
/// 1;` and `SELECT 1` get the same replies, and share an entry (pgbench sends the `;`, most
/// drivers do not).
fn statement_text(text: &[u8]) -> &[u8] {
    let trimmed = text.trim_ascii_end();
    trimmed
        .strip_suffix(b";")
        .map_or(trimmed, |t| t.trim_ascii_end())
}

/// What CACHE FLUSH removes.
pub enum FlushTarget<'a> {
    All,
    Database(&'a str),
    Table(&'a str, &'a str),
}

/// Texts remembered by the first tier ([`ResultCache::raw`]).
const RAW_ENTRIES: usize = 65_536;

/// A client's first-tier probes since its last first-tier hit. A probe that misses costs a
/// few cold cache lines (~0.5 µs of a miss's ~3 on a uniform read of 1,000,000 keys, where the
/// first tier almost never answers: a key it learnt at a hit is seldom read a third time), so
/// after [`FirstTierMisses::STREAK`] misses in a row a client probes one text in
/// [`FirstTierMisses::EVERY`]; the second tier answers the others (the same entries, after the
/// lexer). The first tier still learns at every second-tier hit, so a client whose reads turn
/// hot finds it at its next probe and probes every text again.
#[derive(Default, Clone, Copy)]
struct FirstTierMisses(u16);

impl FirstTierMisses {
    const STREAK: u16 = 16;
    const EVERY: u16 = 8;

    /// Whether to probe for this text; counts it as a miss (a hit resets the count).
    fn probe(&mut self) -> bool {
        self.0 += 1;
        if self.0 <= Self::STREAK {
            return true;
        }
        if self.0 < Self::STREAK + Self::EVERY {
            return false;
        }
        self.0 = Self::STREAK;
        true
    }
}

/// The slot of a database's catalog version (bumped by DDL; plans and snapshots older than it
/// are read again).
fn catalog_slot(versions: &Versions, database: &str) -> u32 {
    versions.table_slot(database, "\0catalog")
}

/// The most row slots a client's open transaction keeps before its writes count as writes
/// to all of its database's data.
const MAX_PENDING_ROWS: usize = 4096;

/// The row counters of `config`: its `row_versions`, or one per 128 bytes of its memory.
fn row_versions(config: &CacheConfig) -> usize {
    match config.row_versions {
        0 => (config.max_memory / 128).max(64),
        n => n as usize,
    }
}

/// What a statement pgmemo cannot analyze may change: anything in its database.
static FLUSH_DATABASE: std::sync::LazyLock<Arc<Analysis>> = std::sync::LazyLock::new(|| {
    Arc::new(Analysis {
        effects: analysis::Effects {
            flush: Flush::Database,
            ..Default::default()
        },
        read: Err(Bypass::NotSelect),
    })
});

/// What a statement that may write through something the catalog shows (a view or policy
/// calling a volatile function) may change: every result of its database, not its catalog.
static FLUSH_DATA: std::sync::LazyLock<Arc<Analysis>> = std::sync::LazyLock::new(|| {
    Arc::new(Analysis {
        effects: analysis::Effects {
            flush: Flush::Data,
            ..Default::default()
        },
        read: Err(Bypass::NotSelect),
    })
});

/// How the chosen rule or hint caches.
#[derive(Debug, Clone, Copy)]
struct Chosen {
    ttl: Duration,
    cache_empty: bool,
    max_result_bytes: usize,
    /// Answered and filled inside READ COMMITTED transaction blocks (see [`Transaction`]).
    transactions: bool,
    /// The part of the TTL after which a read refreshes the entry.
    refresh_at: f64,
}

impl Chosen {
    /// How a hint or auto mode caches, which no rule shapes: the `[cache]` section's
    /// defaults, with `ttl`.
    fn by_section(cfg: &CacheConfig, ttl: Duration) -> Chosen {
        Chosen {
            ttl,
            cache_empty: true,
            max_result_bytes: cfg.max_result_bytes,
            transactions: true,
            refresh_at: cfg.refresh_at,
        }
    }
}

/// A result being captured for the store.
pub struct Fill {
    /// The store's key.
    key: Vec<u8>,
    key_hash: u64,
    /// Stored when it completes (else only if another client waited for it).
    admitted: bool,
    /// Its flight and the cache's flights (to end it even when the fill is dropped); taken
    /// only by [`Fill::end_flight`] (or the drop, which ends it too).
    flight: Option<(Arc<Flight>, Arc<Flights>)>,
    seen: Seen,
    chosen: Chosen,
    stats: Arc<RuleStats>,
    /// Its text and tables, for the entry.
    plan: Arc<Plan>,
    database: Arc<str>,
    reply: BytesMut,
    rows: bool,
    spoiled: Option<Bypass>,
    /// Its replies start with ParseComplete / BindComplete, not stored.
    extended: bool,
    /// Sent inside a READ COMMITTED transaction block: stored at a ReadyForQuery `T`.
    in_block: bool,
    /// The query's shape, for its entry.
    shape: Option<Arc<Shape>>,
}

impl Fill {
    /// Ends the fill's flight (waiters look up again); returns it, reset, when nobody else
    /// holds it, and the flights, for the client's next fill (no allocation per miss, and no
    /// reference count written that every worker's misses write).
    fn end_flight(&mut self) -> (Option<Arc<Flight>>, Option<Arc<Flights>>) {
        let Some((mut flight, flights)) = self.flight.take() else {
            return (None, None);
        };
        flights.end(self.key_hash, &flight);
        flight.finish();
        let reset = Arc::get_mut(&mut flight).map(|f| *f = Flight::default());
        (reset.map(|()| flight), Some(flights))
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        self.end_flight();
    }
}

/// What a client that left had sent, still running on its server when it left: a write
/// that commits after the bump made then would leave whatever was read in between stored
/// under versions that predate it. Bumped again once the server's connection has ended
/// (its backend ends its transaction before it exits).
pub struct Unfinished {
    database: Box<str>,
    effects: Vec<Arc<Analysis>>,
    rows: Vec<u32>,
}

impl Unfinished {
    /// The server the work ran on has ended it.
    pub fn ended(self, cache: &ResultCache) {
        cache.apply(&self.database, &self.effects, &self.rows);
    }
}

/// One client's part: buffers, its notes of writes, its fill.
#[derive(Default)]
pub struct ClientCache {
    /// Whether the client's open transaction block is READ COMMITTED (the cache may answer
    /// inside it), once asked; forgotten when the block ends (the session keeps it).
    pub read_committed: Option<bool>,
    /// The client's `BEGIN`, answered by the session and not sent yet (see
    /// `session::deferred`): what goes to the server ahead of the block's first statement
    /// that needs one. The block is READ COMMITTED (`read_committed` says so).
    pub deferred_begin: Option<Box<str>>,
    /// A statement of the deferred block was answered from the cache: the block has run a
    /// query, as far as the client can tell.
    pub deferred_answered: bool,
    /// The deferred block's `BEGIN` came in the extended protocol: its unnamed portal is the
    /// client's until the block runs a statement (see `session::deferred`).
    pub deferred_portal: bool,
    /// The statement and the Bind (after its two names) of a block's batch the cache answered:
    /// the client's unnamed portal, which PostgreSQL would hold (run to its end) until the
    /// next Bind of it, a Query or the block's end, and no server has (see
    /// `Session::portal_left_by_hit`).
    pub cached_portal: Option<(Arc<crate::statements::Statement>, Box<[u8]>)>,
    /// Made in the middle of a transaction block (see `session::caching::client_cache`): the
    /// block's earlier statements were not seen, so nothing is answered in it; cleared when
    /// it ends.
    pub blind_block: bool,
    key: Vec<u8>,
    context: Vec<u8>,
    /// What `context` was built from.
    context_of: Option<(u64, u32)>,
    /// The search_path the context was built with (None: the server's default), its hash
    /// with the database and the roles (plans are per search_path and role), and the
    /// database.
    search_path: Option<Box<str>>,
    path_hash: u64,
    database: Arc<str>,
    /// The client changed its role or a setting outside the key: no caching for it.
    pub off: bool,
    /// The client changed a setting outside the key for its transaction (`SET LOCAL`): no
    /// caching for it until it is idle again.
    off_in_transaction: bool,
    /// The client may hold temporary objects (see `analysis::Effects::temp`): not answered
    /// from the cache until the session's state probe finds none, or a `DISCARD` drops them.
    pub temp: bool,
    /// A `DISCARD TEMP` or `ALL` was sent, and nothing that may make a temporary object since:
    /// `temp` is cleared when it completes (it fails in a transaction block, or an aborted
    /// one).
    discard_pending: bool,
    /// The client's standard_conforming_strings is off (kept up to date by the session):
    /// its texts are neither cached nor trusted for what they write.
    pub nonstandard_strings: bool,
    /// The session records every setting the client holds (transaction mode's session-state
    /// watch) and keys its results by all of them: a SET or SET ROLE changes the key instead
    /// of turning caching off.
    pub keys_all_settings: bool,
    /// Session mode: the client has one server for its session, so a `DISCARD ALL` it runs
    /// returns that server to the settings and role the key was built from (its startup
    /// packet's): caching turned off by a SET or SET ROLE turns on again when it completes.
    pub resets_on_discard: bool,
    /// A `DISCARD ALL` was sent (see `resets_on_discard`), and no SET or the like since.
    reset_pending: bool,
    /// What the statements sent since the last settled transaction may change.
    pending: Vec<Arc<Analysis>>,
    /// Since `pending` began: an error or a ROLLBACK was seen / a COMMIT was seen /
    /// transactions that ended.
    failed: bool,
    committed: bool,
    ended: u32,
    /// The transaction ID asked for before the block's COMMIT (see [`own_commits`]).
    xid: TransactionId,
    pub fill: Option<Fill>,
    /// What the last fill left for the next.
    spares: Spares,
    /// The slots the last fill depended on (a buffer, kept).
    slots: Vec<u32>,
    /// The slots of rows the statements sent since the last settled transaction named
    /// (see [`rows`]), and the unknown-rows slots of the tables whose rows they did not.
    pending_rows: Vec<u32>,
    /// The first tier's key of the last lookup, and whether it is the Query's at hand
    /// (see [`ResultCache::remember_raw`]).
    raw_key: Vec<u8>,
    raw_key_valid: bool,
    first_tier_misses: FirstTierMisses,
    /// The last hint comment read.
    hint: hint::Memo,
    /// The configuration and rules of [`ResultCache`]'s generation in the first field.
    settings: Option<(u64, Arc<CacheConfig>, Rules)>,
}

/// What a client's block learnt of its transaction ID (see [`own_commits`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum TransactionId {
    #[default]
    Unknown,
    /// Asked, before the block's COMMIT.
    Asked,
    Known(u64),
}

/// The counters of each rule of the configuration, then the hints'.
type Rules = Arc<Vec<Arc<RuleStats>>>;

impl ClientCache {
    /// Whatever was keyed for the first tier before is not the key of the message at hand.
    pub fn forget_message(&mut self) {
        self.raw_key_valid = false;
    }

    /// A client's part; `keys_all_settings`: see [`ClientCache::keys_all_settings`];
    /// `database`: the server database its queries run in (as keys name it).
    pub fn new(keys_all_settings: bool, database: &Arc<str>) -> Box<ClientCache> {
        Box::new(ClientCache {
            keys_all_settings,
            database: database.clone(),
            ..Default::default()
        })
    }

    fn note(&mut self, analysis: &Arc<Analysis>) {
        let e = &analysis.effects;
        if e.session_state && !self.keys_all_settings {
            self.off = true;
            self.reset_pending = false;
        }
        if e.resets_session && self.resets_on_discard {
            self.reset_pending = true;
        }
        // Keyed by all settings, the key is the one the client had when its transaction
        // began: what the transaction changes (`SET LOCAL ROLE` in a block, a `SET` or
        // `set_config` there, `RESET`) is known only from the probe after it ends, and until
        // then the client's reads go to the server.
        if e.transaction_state || (e.session_state && self.keys_all_settings) {
            self.off_in_transaction = true;
        }
        if e.drops_temp {
            self.discard_pending = true;
        }
        if e.temp {
            self.temp = true;
            self.discard_pending = false;
        }
        if e.changes_data() && !self.pending.iter().any(|p| Arc::ptr_eq(p, analysis)) {
            if self.pending.len() >= 256 {
                self.pending.clear();
                self.pending.push(FLUSH_DATABASE.clone());
            }
            self.pending.push(analysis.clone());
        }
    }

    pub fn needs_context(&self, params_version: u64, statement_context: u32) -> bool {
        self.context_of != Some((params_version, statement_context))
    }

    /// Whether the context was built for this search_path.
    pub fn has_search_path(&self, search_path: Option<&str>) -> bool {
        self.search_path.as_deref() == search_path
    }

    /// Sets the part of keys that comes from the client's context.
    pub fn set_context(
        &mut self,
        params_version: u64,
        statement_context: u32,
        database: &str,
        search_path: Option<&str>,
        roles: [Option<&str>; 3],
        parts: &[&str],
    ) {
        if &*self.database != database {
            self.database = database.into();
        }
        self.search_path = search_path.map(Into::into);
        // A name resolves by the search_path as the server expands it: `$user` is the current
        // role, and an unset search_path is the role's default (ALTER ROLE ... SET): plans
        // are per role as well.
        self.path_hash = lexer::hasher().hash_one((database, search_path, roles));
        self.context.clear();
        self.context.extend_from_slice(database.as_bytes());
        self.context.push(0);
        self.context
            .extend_from_slice(&statement_context.to_le_bytes());
        for p in parts {
            self.context.extend_from_slice(p.as_bytes());
            self.context.push(0);
        }
        self.context_of = Some((params_version, statement_context));
    }

    fn build_key(&mut self, lexed: &Lexed) {
        self.key.clear();
        self.key.extend_from_slice(&self.context);
        self.key.extend_from_slice(statement_text(&lexed.text));
        self.key.push(0);
        for literal in lexed.parameters() {
            let value = lexed.value(literal);
            self.key.push(literal.kind.code());
            self.key
                .extend_from_slice(&(value.len() as u32).to_le_bytes());
            self.key.extend_from_slice(value);
        }
    }

    /// Nothing is answered or filled for the client until it is idle again (its transaction
    /// reads a replica's state, see `session::replicas`).
    pub fn off_for_transaction(&mut self) {
        self.off_in_transaction = true;
    }

    /// Whether the client changed its role or a setting outside the key, for its session or
    /// for the transaction at hand.
    #[inline]
    fn caching_off(&self) -> bool {
        self.off || self.off_in_transaction
    }

    /// Why nothing is answered for this client now, whatever the query: a role or setting
    /// outside the key, a temporary table it may hold, backslash-escaping strings.
    fn not_served(&self) -> Option<Bypass> {
        if self.caching_off() {
            Some(Bypass::SessionState)
        } else if self.temp {
            Some(Bypass::Temporary)
        } else if self.nonstandard_strings {
            Some(Bypass::NonstandardStrings)
        } else {
            None
        }
    }

    /// Whether anything is pending for server messages to settle (or to end, see
    /// [`ClientCache::off_in_transaction`]).
    #[inline]
    pub fn watching(&self) -> bool {
        !self.pending.is_empty()
            || self.fill.is_some()
            || self.off_in_transaction
            || self.discard_pending
            || self.reset_pending
    }

    /// Takes in the bytes the session appended to the client's output for one server message
    /// while a fill is open; stores the fill at its ReadyForQuery.
    pub fn capture(&mut self, cache: &ResultCache, out: &[u8]) {
        let Some(fill) = self.fill.as_mut() else {
            return;
        };
        let mut at = 0;
        while at < out.len() {
            let Ok(Some((tag, len))) = crate::protocol::frame(&out[at..], usize::MAX) else {
                fill.spoiled = Some(Bypass::NotPlainResult);
                break;
            };
            let message = &out[at..at + len];
            // PortalSuspended ends a batch's Execute with a row limit (see `Batch`).
            let result = matches!(
                tag,
                be::ROW_DESCRIPTION | be::DATA_ROW | be::COMMAND_COMPLETE
            ) || (tag == be::PORTAL_SUSPENDED && fill.extended);
            match tag {
                be::READY_FOR_QUERY => {
                    let status = message.get(5).copied().unwrap_or(b'I');
                    if let Some(fill) = self.fill.take() {
                        self.spares = cache.store_fill(fill, status);
                    }
                    return;
                }
                _ if result && fill.spoiled.is_none() => {
                    fill.rows |= tag == be::DATA_ROW;
                    if fill.reply.len() + len > fill.chosen.max_result_bytes {
                        fill.spoiled = Some(Bypass::TooLarge);
                        fill.reply.clear();
                    } else {
                        fill.reply.extend_from_slice(message);
                    }
                }
                _ if result => {}
                be::PARSE_COMPLETE | be::BIND_COMPLETE if fill.extended => {}
                _ => {
                    fill.spoiled = Some(Bypass::NotPlainResult);
                    fill.reply.clear();
                }
            }
            at += len;
        }
    }

    /// Follows the transaction in the replies the client gets: once nothing is in flight
    /// and no transaction is open (`idle`), what the statements sent meanwhile may have
    /// changed is bumped, unless all of it was one transaction that failed or rolled back.
    /// A COMMIT bumps at once too. Bumps come before the client reads the reply, so its
    /// next query sees its writes (and so does everyone else's). `forwarded`: the message
    /// reached the client; an error or a `ROLLBACK` of pgmemo's own (a savepoint it rolled
    /// back, a statement it prepares again and retries) is not the client's transaction
    /// failing.
    pub fn settle(
        &mut self,
        cache: &ResultCache,
        database: &str,
        tag: u8,
        body: &[u8],
        forwarded: bool,
        idle: bool,
    ) {
        if tag == be::READY_FOR_QUERY && body.first() == Some(&b'I') {
            self.blind_block = false;
            self.off_in_transaction = false;
        }
        if self.discard_pending
            && forwarded
            && tag == be::COMMAND_COMPLETE
            && (body.starts_with(b"DISCARD TEMP\0") || body.starts_with(b"DISCARD ALL\0"))
        {
            self.discard_pending = false;
            self.temp = false;
        }
        if self.reset_pending
            && forwarded
            && tag == be::COMMAND_COMPLETE
            && body.starts_with(b"DISCARD ALL\0")
        {
            self.reset_pending = false;
            self.off = false;
        }
        if self.pending.is_empty() {
            return;
        }
        match tag {
            be::ERROR_RESPONSE if forwarded => {
                self.failed = true;
                if self.xid == TransactionId::Asked {
                    // The question failed (the block with it): never asked again when the
                    // server refuses the function itself.
                    self.xid = TransactionId::Unknown;
                    let code = be::ErrorFields::parse(body).map(|f| f.code);
                    if matches!(code.as_deref(), Some("42501" | "42883")) {
                        cache.own_commits.refused();
                    }
                }
            }
            be::COMMAND_COMPLETE if forwarded && body.starts_with(b"ROLLBACK") => {
                self.failed = true
            }
            be::DATA_ROW if self.xid == TransactionId::Asked => {
                self.xid = match own_commits::xid_in_data_row(body) {
                    Some(xid) => TransactionId::Known(xid),
                    None => TransactionId::Unknown,
                };
            }
            be::COMMAND_COMPLETE if body.starts_with(b"COMMIT") => {
                self.committed = true;
                cache.apply(database, &self.pending, &self.pending_rows);
                // Noted after the bump: the WAL's may be skipped only once this one is done.
                if let TransactionId::Known(xid) = std::mem::take(&mut self.xid) {
                    cache.own_commits.note(database, xid);
                }
            }
            // A statement ran after the ROLLBACK (`ROLLBACK; UPDATE ...` in one query, or in
            // one pipeline): what it wrote may commit, so the writes are not known undone.
            be::COMMAND_COMPLETE if forwarded => self.failed = false,
            be::READY_FOR_QUERY => {
                if body.first() == Some(&b'I') {
                    self.ended += 1;
                    if !idle {
                        // A transaction ended (committed, for all the session knows) with more
                        // of the client's work behind it (a pipeline: `UPDATE; Sync; BEGIN;
                        // Sync`): other clients may read its writes now, however long what
                        // follows stays open. Bumped now, and again when all has ended (what
                        // is pending may include writes still to run).
                        cache.apply(database, &self.pending, &self.pending_rows);
                    }
                }
                if idle {
                    let undone = self.failed && !self.committed && self.ended == 1;
                    if !undone {
                        cache.apply(database, &self.pending, &self.pending_rows);
                    }
                    self.pending.clear();
                    self.pending_rows.clear();
                    self.failed = false;
                    self.committed = false;
                    self.ended = 0;
                    self.xid = TransactionId::Unknown;
                }
            }
            _ => {}
        }
    }

    /// Before a COMMIT of the client's block (with WAL invalidation): whether to ask the
    /// server for the transaction's ID (see [`own_commits`]). Only for a block that wrote,
    /// all of whose statements were seen, none of which failed; once.
    pub fn asks_transaction_id(&mut self) -> bool {
        let asks = self.may_ask_transaction_id();
        if asks {
            self.xid = TransactionId::Asked;
        }
        asks
    }

    /// Whether [`ClientCache::asks_transaction_id`] would ask now (nothing noted): read before
    /// the statement's text is, so that a block that wrote nothing costs no reading.
    pub fn may_ask_transaction_id(&self) -> bool {
        !(self.pending.is_empty()
            || self.blind_block
            || self.failed
            || self.xid != TransactionId::Unknown)
    }

    /// Nothing of a transaction block or a fill is open: the client could go on in another
    /// process (an online restart) with only `off` and `temp` carried.
    pub fn is_at_rest(&self) -> bool {
        self.deferred_begin.is_none() && self.read_committed.is_none() && self.fill.is_none()
    }

    /// The client left: what it sent may have run to the end without it, so it is bumped
    /// now, and what the caller must bump again once the server it ran on has ended, if that
    /// work may still be running there ([`Unfinished`]).
    pub fn abandon(&mut self, cache: &ResultCache, database: &str) -> Option<Unfinished> {
        self.fill = None;
        if self.pending.is_empty() {
            return None;
        }
        cache.apply(database, &self.pending, &self.pending_rows);
        Some(Unfinished {
            database: database.into(),
            effects: std::mem::take(&mut self.pending),
            rows: std::mem::take(&mut self.pending_rows),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{
        statement_text, CacheConfig, ClientCache, Entry, FirstTierMisses, Flight, Flights, Plan,
        ResultCache, RuleStats,
    };
    use bytes::Bytes;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn entry() -> Arc<Entry> {
        let rule = RuleStats::default();
        rule.chooses.store(true, Relaxed);
        Arc::new(Entry {
            reply: Bytes::from_static(b"reply"),
            expires: Instant::now() + Duration::from_secs(60),
            seen: Default::default(),
            rule: Arc::new(rule),
            text: "".into(),
            tables: Arc::new([]),
            database: "db".into(),
            hits: Default::default(),
            shape: None,
            refresh_at: Instant::now() + Duration::from_secs(48),
            refreshing: Default::default(),
        })
    }

    /// An enabled cache and a client with its context.
    fn cache_and_client() -> (ResultCache, Box<ClientCache>) {
        let cache = ResultCache::new(
            &CacheConfig {
                enabled: true,
                ..Default::default()
            },
            Arc::new(crate::query::shapes::Shapes::new(100)),
        );
        let mut client = ClientCache::new(false, &Arc::from("db"));
        client.set_context(1, 0, "db", None, [Some("role"), None, None], &["role"]);
        (cache, client)
    }

    /// The first tier learns a text at its first hit in the second tier, and only the text
    /// that its last lookup keyed.
    #[test]
    fn the_first_tier_learns_the_text_it_was_asked_for() {
        let (cache, mut client) = cache_and_client();
        let (one, two) = (entry(), entry());
        assert!(cache.raw_hit(&mut client, b"SELECT 1", false).is_none());
        cache.remember_raw(&mut client, &one);
        let hit = cache
            .raw_hit(&mut client, b"SELECT 1", false)
            .expect("learnt");
        assert!(Arc::ptr_eq(&hit, &one));
        // A later message that did not ask the first tier teaches it nothing.
        client.forget_message();
        cache.remember_raw(&mut client, &two);
        let hit = cache
            .raw_hit(&mut client, b"SELECT 1", false)
            .expect("still known");
        assert!(Arc::ptr_eq(&hit, &one));
        // Another context does not see it.
        client.set_context(
            2,
            0,
            "db",
            None,
            [Some("other role"), None, None],
            &["other role"],
        );
        assert!(cache.raw_hit(&mut client, b"SELECT 1", false).is_none());
    }

    /// After a streak of first-tier misses a client probes one text in `EVERY`, and still
    /// learns; a hit at a probe brings every text back to the first tier.
    #[test]
    fn a_client_whose_texts_keep_missing_probes_the_first_tier_less_often() {
        let (cache, mut client) = cache_and_client();
        let (streak, every) = (FirstTierMisses::STREAK, FirstTierMisses::EVERY);
        for i in 0..streak {
            assert!(cache
                .raw_hit(&mut client, format!("SELECT {i}").as_bytes(), false)
                .is_none());
        }
        let one = entry();
        assert!(cache.raw_hit(&mut client, b"SELECT 1", false).is_none());
        cache.remember_raw(&mut client, &one);
        let unprobed = (0..every)
            .take_while(|_| cache.raw_hit(&mut client, b"SELECT 1", false).is_none())
            .count();
        assert_eq!(unprobed, usize::from(every) - 2, "learnt while not probed");
        for _ in 0..2 * streak {
            let hit = cache
                .raw_hit(&mut client, b"SELECT 1", false)
                .expect("probed again");
            assert!(Arc::ptr_eq(&hit, &one));
        }
    }

    #[test]
    fn a_key_has_one_flight_until_it_ends() {
        let flights = Flights::new();
        let (first, second) = (Arc::new(Flight::default()), Arc::new(Flight::default()));
        // Hashes that differ only in the bits that pick the shard, or only in the others.
        let (a, b, c) = (7u64 << 32, 8u64 << 32, (7u64 << 32) | 1);
        assert!(flights.start(a, &first).is_ok());
        let running = flights.start(a, &second).expect_err("a is running");
        assert!(Arc::ptr_eq(&running, &first));
        assert!(flights.start(b, &second).is_ok());
        assert!(flights.start(c, &second).is_ok());
        // Only the flight registered for a key ends it.
        flights.end(a, &second);
        assert!(flights.start(a, &second).is_err());
        flights.end(a, &first);
        assert_eq!(flights.len(), 2);
        assert!(flights.start(a, &second).is_ok());
        for key in [a, b, c] {
            flights.end(key, &second);
        }
        assert_eq!(flights.len(), 0);
    }

    /// Plans are keyed by hashes: a plan serves only the text it was resolved for, so two
    /// texts whose hashes collide never share the tables that invalidate their results.
    #[test]
    fn a_plan_serves_only_its_own_text() {
        let cache = ResultCache::new(
            &CacheConfig::default(),
            Arc::new(crate::query::shapes::Shapes::new(100)),
        );
        let key = (7, 9);
        cache.plans.insert(
            key,
            Arc::new(Plan {
                catalog: 3,
                slots: Ok(Box::new([1, 2])),
                tables: Arc::new(["a".into()]),
                point: None,
                filters: None,
                held: Box::default(),
                one_row: super::rows::OneRow::Never,
                text: "SELECT x FROM a WHERE id = $1".into(),
            }),
        );
        let plan = cache.current_plan(key, 3, b"SELECT x FROM a WHERE id = $1");
        assert_eq!(plan.expect("its text").tables[0].as_ref(), "a");
        assert!(cache
            .current_plan(key, 3, b"SELECT x FROM b WHERE id = $1")
            .is_none());
        // Resolved before the last DDL: stale.
        assert!(cache
            .current_plan(key, 4, b"SELECT x FROM a WHERE id = $1")
            .is_none());
    }

    /// A text too long for the client to keep its first-tier key is looked up, not learnt.
    #[test]
    fn the_first_tier_does_not_learn_a_key_it_did_not_keep() {
        let (cache, mut client) = cache_and_client();
        let long = vec![b'x'; super::MAX_KEPT_BUFFER + 1];
        assert!(cache.raw_hit(&mut client, &long, false).is_none());
        cache.remember_raw(&mut client, &entry());
        assert_eq!(cache.raw.len(), 0);
    }

    #[test]
    fn a_final_semicolon_is_not_part_of_the_key() {
        assert_eq!(statement_text(b"SELECT $1;"), b"SELECT $1");
        assert_eq!(statement_text(b"SELECT $1 ; \n"), b"SELECT $1");
        assert_eq!(statement_text(b"SELECT $1"), b"SELECT $1");
        assert_eq!(statement_text(b"SELECT 1 AS \";\""), b"SELECT 1 AS \";\"");
    }
}
