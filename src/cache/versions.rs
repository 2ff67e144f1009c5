//! Version counters of tables, for invalidation: a cached result remembers the versions of
//! the tables it read and of its database, and is served only while they are unchanged.
//!
//! A fixed array of counters, one per (database, table name) and per version of a table
//! named below: bumping and reading are single atomic operations, with no lock and no
//! allocation. Each name claims a slot of its own at its first use (see [`Slots`]), so two
//! names share one only once the array is nearly full, and two names that share a slot only
//! invalidate each other more often than needed. Tables are named without schema, so
//! a write to `a.t` also invalidates what read `b.t` (rarely costly, never stale).
//!
//! Each table has two counters there: its *any-write* version, bumped by every write to it
//! (what reads of ranges, joins and aggregates depend on), and its *unknown-rows* version,
//! bumped by a write whose rows pgmemo cannot name. A point read (see `cache::rows`) depends
//! on the unknown-rows version and on its rows' versions: a second array, of a size the
//! configuration sets (`cache.row_versions`), indexed by a hash of (database, table, key
//! values). A row's slot is told from a table's by its top bit ([`ROW`]). A read followed
//! column by column (see `cache::columns`) depends instead on a table's [`ColumnVersion`]s,
//! slots of the same table array, and on values' slots in the rows' array.
//!
//! **A commit decoded is not yet a commit seen.** The WAL follower decodes a commit once its
//! record is flushed, but the committing backend becomes visible to other sessions later
//! (after its synchronous standbys answer, after it leaves PostgreSQL's ProcArray). A read
//! sent in between runs on a snapshot without the commit. So the follower's bump is made in
//! two steps ([`Versions::bump_unsettled`], then [`Versions::settle`] once the server shows
//! the transaction visible, see `wal::visibility`): the first changes the version at once
//! (what was stored before is stale) and marks the counter *unsettled* (its top 16 bits count
//! the commits decoded and not yet seen); the second clears the mark. A result is stored
//! only if none of the counters it depends on was unsettled when its query was sent
//! ([`Versions::unchanged`] refuses a capture with a mark) and none changed since: every
//! commit its versions include was then visible before its query's snapshot was taken.

use std::hash::BuildHasher;

use crate::clock::Moment;
use std::sync::atomic::{AtomicU64, Ordering};

const SLOTS: usize = 1 << 14;

/// How many rows' counters share one time of last bump (a shared time is later than a
/// row's own: a fill on a replica waits for more than it must, never for less).
const ROWS_PER_BUMP_TIME: usize = 16;

/// The bit that marks a slot of the row array.
pub const ROW: u32 = 1 << 31;

/// The most row counters the array may have (the slot's bits below [`ROW`]).
pub const MAX_ROW_VERSIONS: usize = (ROW - 1) as usize;

/// One commit decoded and not yet seen, in a counter's top 16 bits (see the module's
/// documentation); the version is the 48 bits below.
const UNSETTLED: u64 = 1 << 48;

/// A table's column-level versions (see `cache::columns`), each a slot of the table array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ColumnVersion {
    /// Bumped by every write that is not known column by column ([`Versions::bump_table`]).
    Whole = 2,
    /// Rows were added or removed.
    RowSet = 3,
    /// Rows were rewritten in place (an `UPDATE`): the order a scan meets them may differ.
    Moved = 4,
    /// Rows were added or removed whose values pgmemo does not know.
    UnknownValues = 5,
    /// A column was assigned (per column).
    Assigned = 6,
    /// A row was added or removed whose value of the column pgmemo does not know (per
    /// column).
    UnknownValue = 7,
}

pub struct Versions {
    /// The slot of each name in `slots`.
    names: Slots,
    slots: Box<[AtomicU64]>,
    /// Rows' versions (see the module's documentation).
    rows: Box<[AtomicU64]>,
    /// When each slot of `slots` was last bumped ([`Moment::nanos`], 0: never), and any of
    /// each [`ROWS_PER_BUMP_TIME`] of `rows`: what a fill on a replica must see is every
    /// commit a primary position read after then covers (see [`Versions::last_bumped`]).
    slots_bumped: Box<[AtomicU64]>,
    rows_bumped: Box<[AtomicU64]>,
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
        Versions::new(1024)
    }
}

/// `slots` in the order a write bumps them: the tables' before the rows' (see
/// [`Versions::bump_slots`]).
fn in_bump_order(slots: &[u32]) -> impl Iterator<Item = u32> + '_ {
    let tables = slots.iter().filter(|&&s| s & ROW == 0);
    tables
        .chain(slots.iter().filter(|&&s| s & ROW != 0))
        .copied()
}

/// Which slot of the table array each name has (a name: its 64-bit hash), so that two names
/// share a slot only once the array is nearly full. A shared slot is never stale, but each
/// write then invalidates the other name's reads too: with hashing alone, an `INSERT` into
/// `posts` invalidated a cached read that used `posts.user_id` whenever the two versions'
/// hashes met, which depended on the database's name (its server's port).
///
/// An open-addressed table beside the counters: a name's slot is the cell its hash claimed,
/// found from the hash's own cell onwards (an atomic load or two while the array has room;
/// claimed by compare-and-swap, so no lock). A name that finds no free cell within
/// [`MAX_PROBES`] shares its hash's own cell with whoever holds it.
struct Slots {
    names: Box<[AtomicU64]>,
    /// Cells a name shares with their holder (it found no free cell): such a cell's held
    /// name does not say every name it stands for (see [`Versions::portable`]).
    crowded: Box<[std::sync::atomic::AtomicBool]>,
}

/// How far a name looks for its cell.
const MAX_PROBES: usize = 256;

impl Slots {
    fn new() -> Slots {
        Slots {
            names: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            crowded: (0..SLOTS)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
        }
    }

    /// The slot of the name that hashed to `hash`.
    #[inline]
    fn of(&self, hash: u64) -> u32 {
        // 0 marks a free cell; a held name's top bit is clear (see [`Versions::portable`]).
        let name = (hash & !PORTABLE_ROW).max(1);
        let home = (name % SLOTS as u64) as usize;
        for probe in 0..MAX_PROBES {
            let at = (home + probe) % SLOTS;
            let cell = &self.names[at];
            let held = match cell.load(Ordering::Acquire) {
                0 => match cell.compare_exchange(0, name, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => name,
                    Err(held) => held,
                },
                held => held,
            };
            if held == name {
                return at as u32;
            }
        }
        self.crowded[home].store(true, Ordering::Release);
        home as u32
    }
}

/// The top bit of a row's portable form (see [`Versions::portable`]).
const PORTABLE_ROW: u64 = 1 << 63;

impl Versions {
    /// Versions with `rows` counters for rows (at least one, at most [`MAX_ROW_VERSIONS`]).
    pub fn new(rows: usize) -> Versions {
        Versions {
            names: Slots::new(),
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            rows: (0..rows.clamp(1, MAX_ROW_VERSIONS))
                .map(|_| AtomicU64::new(0))
                .collect(),
            slots_bumped: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            rows_bumped: (0..rows.clamp(1, MAX_ROW_VERSIONS).div_ceil(ROWS_PER_BUMP_TIME))
                .map(|_| AtomicU64::new(0))
                .collect(),
            all: AtomicU64::new(0),
        }
    }

    /// How many row counters there are.
    pub fn row_versions(&self) -> usize {
        self.rows.len()
    }

    /// The bytes the rows' counters take (counted in the cache's memory), with their times
    /// of bump.
    pub fn row_bytes(&self) -> usize {
        (self.rows.len() + self.rows_bumped.len()) * std::mem::size_of::<AtomicU64>()
    }

    /// The slot of a table's any-write version.
    pub fn table_slot(&self, database: &str, table: &str) -> u32 {
        self.names
            .of(crate::query::lexer::hasher().hash_one((database, table)))
    }

    /// The slot of a table's unknown-rows version.
    pub fn unknown_rows_slot(&self, database: &str, table: &str) -> u32 {
        self.names
            .of(crate::query::lexer::hasher().hash_one((database, table, 1u8)))
    }

    /// The slot of one of a table's column-level versions (see `cache::columns`): `what`
    /// tells them apart, `column` is empty for the table's own.
    pub fn column_slot(
        &self,
        database: &str,
        table: &str,
        column: &str,
        what: ColumnVersion,
    ) -> u32 {
        let hash = crate::query::lexer::hasher().hash_one((database, table, column, what as u8));
        self.names.of(hash)
    }

    /// The slot of the row whose key values hashed to `key_hash` (see `cache::rows`).
    pub fn row_slot(&self, key_hash: u64) -> u32 {
        ROW | (key_hash % self.rows.len() as u64) as u32
    }

    /// `slot` as another instance names it (see `wal::fleet`): a name's hash (top bit
    /// clear), or a row counter's index (top bit set), which means the same row only to an
    /// instance with as many row counters. None for a cell two names share: its held name
    /// does not say which names it stands for here.
    pub fn portable(&self, slot: u32) -> Option<u64> {
        if slot & ROW != 0 {
            return Some(PORTABLE_ROW | u64::from(slot & !ROW));
        }
        let at = slot as usize;
        if self.names.crowded[at].load(Ordering::Acquire) {
            return None;
        }
        match self.names.names[at].load(Ordering::Acquire) {
            0 => None,
            name => Some(name),
        }
    }

    /// This instance's slot of a [`Versions::portable`] form (None: a row index beyond its
    /// row counters).
    pub fn from_portable(&self, portable: u64) -> Option<u32> {
        if portable & PORTABLE_ROW != 0 {
            let index = portable & !PORTABLE_ROW;
            return (index < self.rows.len() as u64).then_some(ROW | index as u32);
        }
        Some(self.names.of(portable))
    }

    /// The slot of the database as a whole (a table name is never empty).
    pub fn database_slot(&self, database: &str) -> u32 {
        self.table_slot(database, "")
    }

    #[inline]
    fn counter(&self, slot: u32) -> &AtomicU64 {
        if slot & ROW == 0 {
            &self.slots[slot as usize]
        } else {
            &self.rows[(slot & !ROW) as usize]
        }
    }

    #[inline]
    fn bumped_at(&self, slot: u32) -> &AtomicU64 {
        if slot & ROW == 0 {
            &self.slots_bumped[slot as usize]
        } else {
            &self.rows_bumped[(slot & !ROW) as usize / ROWS_PER_BUMP_TIME]
        }
    }

    #[inline]
    pub fn get(&self, slot: u32) -> u64 {
        self.counter(slot).load(Ordering::Acquire)
    }

    pub fn bump(&self, slot: u32) {
        self.bump_at(slot, 1, Moment::now());
    }

    /// Adds `by` to `slot`'s counter, its time of bump first: whoever sees the new version
    /// sees a time at or after the bump (see [`Versions::last_bumped`]).
    #[inline]
    fn bump_at(&self, slot: u32, by: u64, now: Moment) {
        self.bumped_at(slot)
            .fetch_max(now.nanos(), Ordering::AcqRel);
        self.counter(slot).fetch_add(by, Ordering::AcqRel);
    }

    /// Marks `slot` as bumped at `now` without changing its version: a commit made before
    /// then may not be known otherwise (a WAL stream that starts: what committed before its
    /// start bumped nothing).
    pub fn mark_bumped(&self, slot: u32, now: Moment) {
        self.bumped_at(slot)
            .fetch_max(now.nanos(), Ordering::AcqRel);
    }

    /// When any of `slots` was last bumped (or marked: [`Versions::mark_bumped`]), 0 if
    /// never. Every commit that changed one of them and was known to pgmemo by then (its
    /// COMMIT's reply relayed, or its record decoded) is covered by any position of the
    /// primary's WAL read after that time: a replica that replayed such a position has them
    /// all.
    pub fn last_bumped(&self, slots: impl Iterator<Item = u32>) -> Moment {
        let at = slots
            .map(|s| self.bumped_at(s).load(Ordering::Acquire))
            .max()
            .unwrap_or(0);
        Moment::from_nanos(at)
    }

    /// Bumps each of `slots` (one write's), the table-level ones before the rows': a result
    /// that holds rows of a table (see `cache::columns::HeldRows`) reads its rows' versions
    /// when it is stored, after its query ran, and then checks that the columns it shows did
    /// not change since it was sent. Seeing a row's new version then means seeing its
    /// column's too, so it is not stored with a version newer than its rows.
    pub fn bump_slots(&self, slots: &[u32]) {
        let now = Moment::now();
        in_bump_order(slots).for_each(|s| self.bump_at(s, 1, now));
    }

    /// The first step of a commit decoded from the WAL (see the module's documentation):
    /// `slots` (its writes', in [`Versions::bump_slots`]' order) change now and stay
    /// unsettled until [`Versions::settle`] is called with the same slots.
    pub fn bump_unsettled(&self, slots: &[u32]) {
        let now = Moment::now();
        for slot in in_bump_order(slots) {
            self.bump_at(slot, UNSETTLED + 1, now);
        }
    }

    /// The second step: the commit of [`Versions::bump_unsettled`]'s `slots` is visible to
    /// every snapshot taken from now on (or everything it guarded was flushed).
    pub fn settle(&self, slots: &[u32]) {
        for &slot in slots {
            self.counter(slot).fetch_sub(UNSETTLED, Ordering::AcqRel);
        }
    }

    /// A write to rows of `table` that pgmemo cannot name: everything that read it is stale.
    pub fn bump_table(&self, database: &str, table: &str) {
        self.table_slots(database, table)
            .iter()
            .for_each(|&s| self.bump(s));
    }

    /// The slots [`Versions::bump_table`] bumps.
    pub fn table_slots(&self, database: &str, table: &str) -> [u32; 3] {
        [
            self.unknown_rows_slot(database, table),
            self.column_slot(database, table, "", ColumnVersion::Whole),
            self.table_slot(database, table),
        ]
    }

    /// A write to rows of `table` whose own slots are bumped too (by the caller): what read
    /// more than those rows is stale, a point read of other rows is not.
    pub fn bump_table_writes(&self, database: &str, table: &str) {
        self.bump(self.table_slot(database, table));
    }

    pub fn bump_database(&self, database: &str) {
        self.bump(self.database_slot(database));
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

    /// Whether nothing `seen` depended on changed since, and nothing was unsettled when it
    /// was captured (a commit decoded then may not have been visible to its query).
    pub fn unchanged(&self, seen: &Seen) -> bool {
        self.all.load(Ordering::Acquire) == seen.all
            && seen
                .slots
                .iter()
                .all(|&(s, v)| v < UNSETTLED && self.get(s) == v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bump_changes_what_depended_on_it() {
        let v = Versions::default();
        let t = v.table_slot("db", "t");
        let d = v.database_slot("db");
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
    fn rows_and_tables_have_their_own_counters() {
        let v = Versions::new(4);
        let (t, u) = (v.table_slot("db", "t"), v.unknown_rows_slot("db", "t"));
        assert_ne!(t, u);
        let (r7, r8) = (v.row_slot(7), v.row_slot(8));
        assert!(r7 & ROW != 0 && r8 & ROW != 0 && r7 != r8);
        // Four counters: 11 shares 7's (a collision only invalidates more).
        assert_eq!(v.row_slot(11), r7);
        let point = v.capture(&[u, r7], Seen::default());
        let range = v.capture(&[t], Seen::default());
        v.bump_table_writes("db", "t");
        v.bump(r8);
        assert!(v.unchanged(&point), "a write to another row");
        assert!(!v.unchanged(&range));
        v.bump(r7);
        assert!(!v.unchanged(&point));
        let point = v.capture(&[u, r7], Seen::default());
        v.bump_table("db", "t");
        assert!(!v.unchanged(&point), "rows not named");
        assert_eq!(v.row_versions(), 4);
    }

    #[test]
    fn a_commit_decoded_but_not_seen_keeps_what_was_read_meanwhile_out() {
        let v = Versions::new(8);
        let (t, r) = (v.table_slot("db", "t"), v.row_slot(3));
        let before = v.capture(&[t, r], Seen::default());
        v.bump_unsettled(&[r, t]);
        assert!(!v.unchanged(&before), "stale from the decode on");
        // Read while the commit is not known visible: never stored, even with no change since.
        let meanwhile = v.capture(&[t, r], Seen::default());
        assert!(!v.unchanged(&meanwhile));
        let other = v.capture(&[v.table_slot("db", "u")], Seen::default());
        assert!(v.unchanged(&other), "another table's reads are stored");
        // Two commits of the same row decoded, one settled: still unsettled.
        v.bump_unsettled(&[r]);
        v.settle(&[r, t]);
        assert!(!v.unchanged(&v.capture(&[r], Seen::default())));
        assert!(v.unchanged(&v.capture(&[t], Seen::default())));
        v.settle(&[r]);
        let after = v.capture(&[t, r], Seen::default());
        assert!(v.unchanged(&after));
        assert!(
            !v.unchanged(&before),
            "settling keeps the versions the decode made"
        );
    }

    /// Names claim slots of their own: no two of the first half of [`SLOTS`] share one (with
    /// hashing alone, about one pair in 16,000 did), and a name keeps its slot.
    #[test]
    fn a_slot_reads_the_same_on_another_instance() {
        let (a, b) = (Versions::new(64), Versions::new(64));
        // b met another name first that took the cell a gave "t": its slot of "t" differs.
        let t = a.table_slot("db", "t");
        (0..).find(|i| b.table_slot("db", &format!("other{i}")) == t);
        let names = [
            a.table_slot("db", "t"),
            a.unknown_rows_slot("db", "t"),
            a.database_slot("db"),
            a.row_slot(12345),
        ];
        let there: Vec<u32> = names
            .iter()
            .map(|&s| b.from_portable(a.portable(s).unwrap()).unwrap())
            .collect();
        assert_eq!(
            there,
            [
                b.table_slot("db", "t"),
                b.unknown_rows_slot("db", "t"),
                b.database_slot("db"),
                b.row_slot(12345),
            ]
        );
        assert_ne!(names[0], there[0], "the slots differ, the names do not");
        // A cell two names share says neither.
        let full = Versions::new(1);
        let mut shared = None;
        for i in 0..(SLOTS + MAX_PROBES) {
            let slot = full.table_slot("db", &format!("t{i}"));
            if full.portable(slot).is_none() {
                shared = Some(slot);
                break;
            }
        }
        assert!(shared.is_some(), "a full array shares cells, and says so");
        assert_eq!(Versions::new(8).from_portable(PORTABLE_ROW | 9), None);
    }

    #[test]
    fn each_name_has_its_own_slot_while_there_is_room() {
        let v = Versions::default();
        let db = "127.0.0.1:42323/rows_proxy";
        let mut given = std::collections::HashMap::new();
        for i in 0..SLOTS / 2 {
            let (table, column) = (format!("t{}", i / 7), format!("c{}", i % 7));
            let slot = v.column_slot(db, &table, &column, ColumnVersion::Assigned);
            assert!((slot as usize) < SLOTS);
            if let Some(other) = given.insert(slot, (table, column)) {
                panic!("slot {slot} given twice, the second time to {other:?}");
            }
        }
        for (slot, (table, column)) in &given {
            assert_eq!(
                v.column_slot(db, table, column, ColumnVersion::Assigned),
                *slot
            );
        }
        // The pair that met by hash in a run of tests/row_invalidation.rs.
        let (row_set, user_id) = (
            v.column_slot(db, "posts", "", ColumnVersion::RowSet),
            v.column_slot(db, "posts", "user_id", ColumnVersion::Assigned),
        );
        assert_ne!(row_set, user_id);
    }

    #[test]
    fn a_capture_into_a_spare_reads_the_versions_now() {
        let v = Versions::default();
        let (d, t, u) = (
            v.database_slot("db"),
            v.table_slot("db", "t"),
            v.table_slot("db", "u"),
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

    #[test]
    fn each_slot_knows_when_it_was_last_bumped() {
        let v = Versions::new(64);
        let (d, t) = (v.database_slot("db"), v.table_slot("db", "t"));
        let (r, shares) = (v.row_slot(3), v.row_slot(4));
        assert_eq!(
            v.last_bumped([d, t, r].into_iter()).nanos(),
            0,
            "never bumped"
        );
        let before = Moment::now();
        v.bump_slots(&[t]);
        let bumped = v.last_bumped([d, t].into_iter());
        assert!(bumped >= before);
        assert_eq!(v.last_bumped([d].into_iter()).nanos(), 0);
        // Rows share their time with their neighbours (later than their own: never earlier).
        v.bump_unsettled(&[r]);
        assert!(v.last_bumped([shares].into_iter()) >= bumped);
        // A mark moves the time, not the version.
        let version = v.get(d);
        let marked = Moment::now();
        v.mark_bumped(d, marked);
        assert_eq!(v.get(d), version);
        assert_eq!(v.last_bumped([d, t].into_iter()), marked);
    }
}
