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
}

impl Admission {
    pub fn new() -> Admission {
        Admission {
            doorkeeper: (0..DOORKEEPER_WORDS).map(|_| AtomicU64::new(0)).collect(),
            set: AtomicU64::new(0),
            window: AtomicU64::new(LONGEST_WINDOW),
            full: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The flag the store's eviction hook sets.
    pub fn full_flag(&self) -> Arc<AtomicBool> {
        self.full.clone()
    }

    /// Whether the result of a miss on `key_hash` is to be stored (the miss is recorded
    /// either way).
    pub fn admits(&self, key_hash: u64, store: &Store) -> bool {
        self.seen_before(key_hash, store) || !self.full.load(Relaxed)
    }

    /// After entries were removed (a flush, a new capacity): full again at the next eviction.
    pub fn shrunk(&self) {
        self.full.store(false, Relaxed);
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
            // Learnt again each window: entries that expire leave room without an eviction.
            let window = if self.full.swap(false, Relaxed) {
                (store.len() as u64).clamp(SHORTEST_WINDOW, LONGEST_WINDOW)
            } else {
                LONGEST_WINDOW
            };
            self.window.store(window, Relaxed);
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::LONGEST_WINDOW;
    use crate::cache::{CacheConfig, Entry, KeyRef, ResultCache};
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;

    /// Stores entries under keys `*n..` until the store evicts one.
    fn fill(cache: &ResultCache, n: &mut u64) {
        while !cache.admission.full.load(Relaxed) {
            let entry = Entry {
                reply: vec![0u8; 1000].into(),
                expires: std::time::Instant::now(),
                seen: Default::default(),
                rule: Default::default(),
                text: "".into(),
                tables: Arc::new([]),
                database: "db".into(),
                hits: Default::default(),
            };
            cache
                .store
                .insert(KeyRef::new(&n.to_le_bytes()).to_key(), Arc::new(entry));
            *n += 1;
        }
    }

    /// While the store has room every miss is admitted; once it is full, only a key's second
    /// miss within about as many first misses as the store holds entries.
    #[test]
    fn a_full_store_admits_second_misses_within_its_length() {
        let cache = ResultCache::new(&CacheConfig {
            enabled: true,
            max_memory: 8 << 20,
            ..Default::default()
        });
        let (admission, store, mut n) = (&cache.admission, &cache.store, 0);
        assert!(admission.admits(1, store), "room: a first miss");
        fill(&cache, &mut n);
        assert!(!admission.admits(2, store), "full: a first miss");
        assert!(admission.admits(2, store), "full: its second miss");
        // The first window, learnt while the store had room, is the longest; the next (the
        // store was full during this one) is the store's length.
        for hash in 3..=LONGEST_WINDOW {
            assert!(!admission.admits(hash, store), "distinct bits");
        }
        assert!(
            admission.admits(LONGEST_WINDOW + 1, store),
            "reset: room until an eviction"
        );
        let entries = store.len() as u64;
        assert!(
            entries > 1024 && entries < LONGEST_WINDOW,
            "{entries} entries"
        );
        assert_eq!(admission.window.load(Relaxed), entries);
        fill(&cache, &mut n);
        let key = LONGEST_WINDOW + 2;
        assert!(!admission.admits(key, store));
        assert!(admission.admits(key, store));
        for hash in 0..entries {
            admission.admits(LONGEST_WINDOW + 3 + hash, store);
        }
        fill(&cache, &mut n);
        assert!(!admission.admits(key, store), "forgotten after a window");
        store.clear();
        admission.shrunk();
        assert!(admission.admits(key + 1, store), "room again");
    }
}
