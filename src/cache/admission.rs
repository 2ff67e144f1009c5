//! Which misses are stored (`cache.admit_after = 2`, the default).
//!
//! While the store has room, every miss is stored: an entry costs memory nobody else uses,
//! and a key read twice then misses once instead of twice (on a Zipf-distributed read of
//! 100,000 keys the hit ratio went from ~95% to ~98%). Once it is full, a store evicts an
//! entry, and a key is stored only at its second miss within a window (a doorkeeper: one bit
//! per key hash, all cleared after the window's first misses), so keys read once cost no
//! store and evict nothing useful. An entry then survives about as many stores as the store
//! holds entries, so the window is that long: a key that does not come back within it would
//! be evicted before its next read (a uniform read of 1,000,000 keys, eight times what a
//! 64 MiB store holds, stored one miss in eight instead of one in three, each store an
//! allocation, a copy and an eviction, for a hit ratio of a few percent).

use super::Store;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// 2^20 bits: 128 KiB, for about half a million recent one-off keys before a reset.
const DOORKEEPER_WORDS: usize = 1 << 14;
/// The longest window: half the bits (while the store has room).
const LONGEST_WINDOW: u64 = DOORKEEPER_WORDS as u64 * 64 / 2;
/// The shortest window, for a full store of few (large) entries.
const SHORTEST_WINDOW: u64 = 1024;

pub struct Admission {
    doorkeeper: Box<[AtomicU64]>,
    /// Bits set since the last reset.
    set: AtomicU64,
    /// First misses until the doorkeeper is cleared.
    window: AtomicU64,
    /// The store evicted an entry to make room since the last reset or flush: it is full.
    /// Set by the store's eviction hook ([`Admission::full_flag`]).
    full: Arc<AtomicBool>,
    /// `window` is sized for a full store (it was full at the last reset, or filled since):
    /// the longest window lasts only while the store has room (a uniform read of 1,000,000
    /// keys took ~50 s to end it once the store had filled, storing half its misses).
    sized: AtomicBool,
}

impl Admission {
    pub fn new() -> Admission {
        Admission {
            doorkeeper: (0..DOORKEEPER_WORDS).map(|_| AtomicU64::new(0)).collect(),
            set: AtomicU64::new(0),
            window: AtomicU64::new(LONGEST_WINDOW),
            full: Arc::new(AtomicBool::new(false)),
            sized: AtomicBool::new(false),
        }
    }

    /// The flag the store's eviction hook sets.
    pub fn full_flag(&self) -> Arc<AtomicBool> {
        self.full.clone()
    }

    /// Whether the result of a miss on `key_hash` is to be stored (the miss is recorded
    /// either way).
    pub fn admits(&self, key_hash: u64, store: &Store) -> bool {
        let seen = self.seen_before(key_hash, store);
        let full = self.full.load(Relaxed);
        if full && !self.sized.load(Relaxed) && !self.sized.swap(true, Relaxed) {
            // The store just filled: an entry now survives about as many stores as it holds
            // entries, and the window shrinks to that at once.
            self.window.store(full_window(store), Relaxed);
        }
        seen || !full
    }

    /// After entries were removed (a flush, a new capacity): full again at the next eviction.
    pub fn shrunk(&self) {
        self.full.store(false, Relaxed);
        self.sized.store(false, Relaxed);
    }

    /// Whether a key (by hash) missed before, within the window.
    fn seen_before(&self, key_hash: u64, store: &Store) -> bool {
        let bits = self.doorkeeper.len() as u64 * 64;
        let bit = key_hash % bits;
        let mask = 1u64 << (bit % 64);
        let before = self.doorkeeper[(bit / 64) as usize].fetch_or(mask, Relaxed);
        if before & mask != 0 {
            return true;
        }
        if self.set.fetch_add(1, Relaxed) + 1 > self.window.load(Relaxed) {
            self.set.store(0, Relaxed);
            for word in self.doorkeeper.iter() {
                word.store(0, Relaxed);
            }
            // Learnt again each window: entries that expire leave room without an eviction
            // (the longest window then, until the next eviction sizes it again).
            let was_full = self.full.swap(false, Relaxed);
            let window = if was_full {
                full_window(store)
            } else {
                LONGEST_WINDOW
            };
            self.window.store(window, Relaxed);
            self.sized.store(was_full, Relaxed);
        }
        false
    }
}

/// The window once the store is full: an entry survives about as many stores as the store
/// holds entries.
fn full_window(store: &Store) -> u64 {
    (store.len() as u64).clamp(SHORTEST_WINDOW, LONGEST_WINDOW)
}

#[cfg(test)]
mod tests {
    use super::LONGEST_WINDOW;
    use crate::cache::{CacheConfig, Entry, KeyRef, ResultCache};
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn cache_of_8_mib() -> ResultCache {
        ResultCache::new(
            &CacheConfig {
                enabled: true,
                max_memory: 8 << 20,
                ..Default::default()
            },
            Arc::new(crate::query::shapes::Shapes::new(100)),
        )
    }

    /// Stores entries under keys `*n..` until the store evicts one.
    fn fill(cache: &ResultCache, n: &mut u64) {
        while !cache.admission.full.load(Relaxed) {
            cache
                .store
                .insert(KeyRef::new(&n.to_le_bytes()).to_key(), entry(1000));
            *n += 1;
        }
    }

    fn entry(reply_bytes: usize) -> Arc<Entry> {
        expiring_entry(reply_bytes, Duration::from_secs(60))
    }

    fn expiring_entry(reply_bytes: usize, ttl: Duration) -> Arc<Entry> {
        Arc::new(Entry {
            reply: vec![0u8; reply_bytes].into(),
            expires: Instant::now() + ttl,
            seen: Default::default(),
            rule: Default::default(),
            text: "".into(),
            tables: Arc::new([]),
            database: "db".into(),
            hits: Default::default(),
            shape: None,
            refresh_at: Instant::now() + ttl,
            refreshing: Default::default(),
        })
    }

    /// While the store has room every miss is admitted; once it is full, only a key's second
    /// miss within about as many first misses as the store holds entries.
    #[test]
    fn a_full_store_admits_second_misses_within_its_length() {
        let cache = cache_of_8_mib();
        let (admission, store, mut n) = (&cache.admission, &cache.store, 0);
        assert!(admission.admits(1, store), "room: a first miss");
        assert_eq!(admission.window.load(Relaxed), LONGEST_WINDOW, "room");
        fill(&cache, &mut n);
        assert!(!admission.admits(2, store), "full: a first miss");
        let entries = store.len() as u64;
        assert!(
            entries > 1024 && entries < LONGEST_WINDOW,
            "{entries} entries"
        );
        // Sized at the first eviction, not at the end of the window learnt with room.
        assert_eq!(admission.window.load(Relaxed), entries);
        assert!(admission.admits(2, store), "full: its second miss");
        for hash in 0..entries {
            admission.admits(LONGEST_WINDOW + 3 + hash, store);
        }
        assert!(
            admission.admits(1 << 40, store),
            "reset: room until an eviction"
        );
        assert_eq!(admission.window.load(Relaxed), entries);
        fill(&cache, &mut n);
        let key = LONGEST_WINDOW + 2;
        assert!(!admission.admits(key, store));
        assert!(admission.admits(key, store));
        for hash in 0..entries {
            admission.admits((1 << 41) + hash, store);
        }
        fill(&cache, &mut n);
        assert!(!admission.admits(key, store), "forgotten after a window");
        store.clear();
        admission.shrunk();
        assert!(admission.admits(key + 1, store), "room again");
    }

    /// Entries evicted after their TTL leave room: a store of expired entries is not full,
    /// and stores every miss until it evicts one still good.
    #[test]
    fn evicting_expired_entries_is_not_being_full() {
        let cache = cache_of_8_mib();
        let (admission, store) = (&cache.admission, &cache.store);
        let mut n = 0u64;
        let mut insert = |ttl| {
            n += 1;
            store.insert(
                KeyRef::new(&n.to_le_bytes()).to_key(),
                expiring_entry(1000, ttl),
            );
        };
        // Twice what the store holds (its entries weigh ~1.4 KB each), all expired.
        let holds = (8 << 20) / 1400;
        for _ in 0..2 * holds {
            insert(Duration::ZERO);
        }
        assert!(
            !admission.full.load(Relaxed),
            "only expired entries were evicted"
        );
        assert!(admission.admits(1, store), "room: a first miss");
        for _ in 0..2 * holds {
            insert(Duration::from_secs(60));
        }
        assert!(admission.full.load(Relaxed), "evicted good entries");
        assert!(!admission.admits(2, store), "full: a first miss");
    }

    /// A uniform read of eight times the keys the store holds: once the store is full, a
    /// key read once in a window is not stored, so few misses are (one in thirteen here;
    /// before the window was sized at the first eviction, most of them for a long while).
    #[test]
    fn a_uniform_read_of_more_keys_than_fit_stores_few_misses() {
        let cache = cache_of_8_mib();
        let (admission, store) = (&cache.admission, &cache.store);
        let mut keys = 0x9e37_79b9_7f4a_7c15_u64; // xorshift64: the same stream every run
        let mut next_key = || {
            keys ^= keys << 13;
            keys ^= keys >> 7;
            keys ^= keys << 17;
            let mut key = vec![b'k'; 90];
            key.extend_from_slice(&(keys % 140_000).to_le_bytes());
            key
        };
        let (mut misses, mut stored) = (0, 0);
        for i in 0.. {
            let key = next_key();
            let key = KeyRef::new(&key);
            if store.get(&key).is_some() {
                continue;
            }
            let full = admission.full.load(Relaxed);
            if admission.admits(key.hash, store) {
                store.insert(key.to_key(), entry(60));
                stored += u64::from(full);
            }
            misses += u64::from(full);
            if misses == 100_000 {
                break;
            }
            assert!(i < 1_000_000, "the store never filled");
        }
        let entries = store.len() as u64;
        assert!(entries > 10_000 && entries < 20_000, "{entries} entries");
        assert!(stored * 5 < misses, "{stored} of {misses} misses stored");
    }
}
