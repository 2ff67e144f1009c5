//! Fill and store: a miss opens the client's [`Fill`] ([`ResultCache::start_fill`]) with the
//! versions of everything its result depends on (its tables', or its rows' and columns' values'
//! when the plan knows them); the replies are captured as the client gets them and stored at
//! their ReadyForQuery ([`ResultCache::store_fill`]). The store is bounded by `max_memory`
//! (entries weighed by their bytes) and counts its evictions per rule. Which key is looked up
//! is the lookup's (`lookup.rs`), what bumps the versions the invalidation's
//! (`invalidation.rs`). A result in doubt is not stored: one whose versions changed before it
//! came back, one that is not a plain result or is too large, a first miss admission turns away.

use super::client::ClientCache;
use super::flights::{Flight, Flights};
use super::key::{Key, KeyIsHash};
use super::lookup::Chosen;
use super::plans::Plan;
use super::versions::Seen;
use super::{columns, rows, Entry, ResultCache, RuleStats, Shape};
use crate::query::analysis::Bypass;
use bytes::{Bytes, BytesMut};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

/// A client's reused buffer (a fill's reply, its key, the first tier's key) that grew past
/// this for one long text is dropped rather than kept for every idle client.
pub(super) const MAX_KEPT_BUFFER: usize = 64 * 1024;

#[derive(Clone)]
pub(super) struct EntryWeight;

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
pub(super) struct Evictions {
    pub(super) full: Arc<AtomicBool>,
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

pub(super) type Store =
    quick_cache::sync::Cache<Key, Arc<Entry>, EntryWeight, KeyIsHash, Evictions>;

impl ResultCache {
    /// Opens the client's fill for a miss (its key in `client.key`), whose flight started:
    /// the result is captured from the replies and stored at their ReadyForQuery.
    pub(super) fn start_fill(
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
            position: 0,
            shared_key: None,
        });
    }

    /// Stores a finished fill (see [`ClientCache::capture`]) if it may be; gives its buffers
    /// (reply, key) and its flight back for the client's next fill.
    pub(super) fn store_fill(&self, mut fill: Fill, status: u8) -> Spares {
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
                if let Some(shared) = self.shared().filter(|_| fill.position > 0) {
                    shared.put(
                        fill.shared_key(),
                        fill.position,
                        &entry.reply,
                        fill.chosen.ttl,
                    );
                }
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
}

/// A miss whose fill starts (see [`ResultCache::start_fill`]).
pub(super) struct Miss {
    pub(super) key_hash: u64,
    pub(super) flight: Arc<Flight>,
    pub(super) chosen: Chosen,
    pub(super) stats: Arc<RuleStats>,
    pub(super) plan: Arc<Plan>,
    pub(super) extended: bool,
    pub(super) in_block: bool,
    pub(super) shape: Option<Arc<Shape>>,
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

/// What a finished fill leaves for the client's next (no allocation per miss): its
/// buffers, and its flight when nobody else holds it any more.
#[derive(Default)]
pub(super) struct Spares {
    reply: BytesMut,
    key: Vec<u8>,
    /// Empty when the fill was stored (its versions went to the entry).
    seen: Seen,
    pub(super) flight: Option<Arc<Flight>>,
    /// The cache's flights, held by a fill to end its flight when it is dropped: passed from
    /// fill to fill, not cloned for each (a count written by every worker's misses).
    flights: Option<Arc<Flights>>,
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
    pub(super) chosen: Chosen,
    stats: Arc<RuleStats>,
    /// Its text and tables, for the entry.
    plan: Arc<Plan>,
    database: Arc<str>,
    pub(super) reply: BytesMut,
    pub(super) rows: bool,
    pub(super) spoiled: Option<Bypass>,
    /// Its replies start with ParseComplete / BindComplete, not stored.
    pub(super) extended: bool,
    /// With the shared tier: the WAL position its query saw whole (the follower's applied
    /// position when it was sent), written there with it once stored; 0: not written.
    position: u64,
    /// The shared tier's key when the store's names something only this process knows (an
    /// extended statement's number: see `lookup_statement`).
    shared_key: Option<Box<[u8]>>,
    /// Sent inside a READ COMMITTED transaction block: stored at a ReadyForQuery `T`.
    in_block: bool,
    /// The query's shape, for its entry.
    shape: Option<Arc<Shape>>,
}

impl Fill {
    /// The slots its result depends on.
    pub(super) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.seen.slots.iter().map(|&(slot, _)| slot)
    }

    pub(super) fn seen(&self) -> &Seen {
        &self.seen
    }

    /// The store's key (the shared tier's too, after its prefix).
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// Its key in the shared tier (after the tier's prefix): the store's, unless that names
    /// something only this process knows.
    pub fn shared_key(&self) -> &[u8] {
        self.shared_key.as_deref().unwrap_or(&self.key)
    }

    /// Answered from the shared tier, whose entry lives `remaining` longer: stored here, it
    /// lives no longer.
    pub fn expires_within(&mut self, remaining: Duration) {
        self.chosen.ttl = self.chosen.ttl.min(remaining);
    }

    pub(super) fn set_shared_key(&mut self, key: Box<[u8]>) {
        self.shared_key = Some(key);
    }

    /// The server database it reads.
    pub fn database(&self) -> &str {
        &self.database
    }

    /// Its query is sent when the follower's applied position is `position` (see
    /// [`super::shared`]): stored, it is written to the shared tier with it. 0: not written
    /// (a result that came from there).
    pub fn saw(&mut self, position: u64) {
        self.position = position;
    }

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
