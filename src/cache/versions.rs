//! Version counters of tables, for invalidation: a cached result remembers the versions of
//! the tables it read and of its database, and is served only while they are unchanged.
//!
//! A fixed array of counters, indexed by a hash of (database, table name): bumping and reading
//! are single atomic operations, with no lock and no allocation; two tables that share a slot
//! only invalidate each other more often than needed. Tables are named without schema, so a
//! write to `a.t` also invalidates what read `b.t` (rarely costly, never stale). The WAL
//! follower (a later issue) only has to call [`Versions::bump_table`].

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

const SLOTS: usize = 1 << 14;

pub struct Versions {
    slots: Box<[AtomicU64]>,
    /// Bumped by a flush of everything.
    all: AtomicU64,
}

/// The versions a result depended on when its query was sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    pub all: u64,
    /// (slot, version); the database's own slot first.
    pub slots: Box<[(u32, u64)]>,
}

impl Default for Versions {
    fn default() -> Self {
        Versions {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            all: AtomicU64::new(0),
        }
    }
}

fn slot_of(database: &str, table: &str) -> u32 {
    let hash = crate::query::lexer::hasher().hash_one((database, table));
    (hash as usize % SLOTS) as u32
}

impl Versions {
    /// The slot of a table of a database.
    pub fn table_slot(database: &str, table: &str) -> u32 {
        slot_of(database, table)
    }

    /// The slot of the database as a whole (a table name is never empty).
    pub fn database_slot(database: &str) -> u32 {
        slot_of(database, "")
    }

    pub fn get(&self, slot: u32) -> u64 {
        self.slots[slot as usize].load(Ordering::Acquire)
    }

    pub fn bump(&self, slot: u32) {
        self.slots[slot as usize].fetch_add(1, Ordering::AcqRel);
    }

    pub fn bump_table(&self, database: &str, table: &str) {
        self.bump(slot_of(database, table));
    }

    pub fn bump_database(&self, database: &str) {
        self.bump(Self::database_slot(database));
    }

    pub fn bump_all(&self) {
        self.all.fetch_add(1, Ordering::AcqRel);
    }

    /// The current versions of `slots`, in `spare`'s memory when it has their number (a
    /// client's last capture that was not stored: no allocation per miss).
    pub fn capture(&self, slots: &[u32], spare: Seen) -> Seen {
        let all = self.all.load(Ordering::Acquire);
        let mut seen = spare.slots;
        if seen.len() == slots.len() {
            for (to, &s) in seen.iter_mut().zip(slots) {
                *to = (s, self.get(s));
            }
        } else {
            seen = slots.iter().map(|&s| (s, self.get(s))).collect();
        }
        Seen { all, slots: seen }
    }

    /// Whether nothing `seen` depended on changed since.
    pub fn unchanged(&self, seen: &Seen) -> bool {
        self.all.load(Ordering::Acquire) == seen.all
            && seen.slots.iter().all(|&(s, v)| self.get(s) == v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bump_changes_what_depended_on_it() {
        let v = Versions::default();
        let t = Versions::table_slot("db", "t");
        let d = Versions::database_slot("db");
        let seen = v.capture(&[d, t], Seen::default());
        assert!(v.unchanged(&seen));
        v.bump_table("db", "t");
        assert!(!v.unchanged(&seen));
        let seen = v.capture(&[d, t], Seen::default());
        v.bump_database("db");
        assert!(!v.unchanged(&seen));
        let seen = v.capture(&[d, t], Seen::default());
        v.bump_all();
        assert!(!v.unchanged(&seen));
    }

    #[test]
    fn a_capture_into_a_spare_reads_the_versions_now() {
        let v = Versions::default();
        let (d, t, u) = (
            Versions::database_slot("db"),
            Versions::table_slot("db", "t"),
            Versions::table_slot("db", "u"),
        );
        let old = v.capture(&[d, t], Seen::default());
        v.bump_table("db", "t");
        v.bump_all();
        // Same length: the spare's memory, today's versions; another length: new memory.
        let reused = v.capture(&[d, u], old.clone());
        assert_eq!(reused, v.capture(&[d, u], Seen::default()));
        assert!(v.unchanged(&reused));
        let longer = v.capture(&[d, t, u], old);
        assert_eq!(longer.slots.len(), 3);
        assert!(v.unchanged(&longer));
    }
}
