//! With WAL invalidation, the transactions made through pgmemo that it already bumped at
//! their COMMIT: their WAL need not bump again.
//!
//! A write through pgmemo is bumped when its COMMIT's reply comes (read-your-writes: the WAL
//! arrives later). Its WAL would bump it a second time, and more coarsely (PostgreSQL's
//! default replica identity shows an UPDATE's new row, not which columns it changed), which
//! invalidates what was read again between the two: each result read after the COMMIT
//! already holds the write. So before a COMMIT of a block that wrote, pgmemo asks the
//! server for the transaction's ID (`txid_current_if_assigned()`, in the same write as the
//! COMMIT), and once the COMMIT's bump is done notes (database, ID) here; the WAL decoder
//! takes the note at that transaction's commit and bumps nothing for it.
//!
//! Sound because the bump at COMMIT covers everything the transaction may have written
//! (what proxy invalidation relies on: a statement pgmemo cannot read is a write to
//! everything its database holds), and because a transaction is noted only when the client
//! cache saw the whole block. A note whose WAL comes before it (the WAL was quicker than
//! the reply) or never comes (a transaction that wrote only temporary tables) is never
//! taken: it costs only its memory, bounded here, and is not taken after [`MAX_AGE`] (the
//! WAL names a transaction by the low 32 bits of its ID, which come round again).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Notes kept at most; past it all are dropped (a dropped note only means one more bump).
const MAX_NOTES: usize = 4096;

/// A note older than this is not taken (its WAL is late: the database is bumped as usual).
const MAX_AGE: Duration = Duration::from_secs(60);

#[derive(Default)]
pub struct OwnCommits {
    /// (database, low 32 bits of the ID) → when noted.
    notes: papaya::HashMap<(Box<str>, u32), Instant, foldhash::fast::RandomState>,
    /// Transactions whose WAL bumped nothing (SHOW CACHE's `wal_own_commits`).
    pub skipped: AtomicU64,
    /// A server refused the question (`txid_current_if_assigned()` revoked or missing): it
    /// is not asked again (the refusal failed a client's block).
    refused: AtomicBool,
}

impl OwnCommits {
    /// The transaction `xid` (its low 32 bits, as the WAL names it) of `database` committed
    /// through pgmemo and was bumped.
    pub fn note(&self, database: &str, xid: u64) {
        let notes = self.notes.pin();
        if notes.len() >= MAX_NOTES {
            notes.clear();
        }
        notes.insert((database.into(), xid as u32), Instant::now());
    }

    /// Whether a block's COMMIT may be preceded by the question.
    #[inline]
    pub fn asks(&self) -> bool {
        !self.refused.load(Relaxed)
    }

    /// A server refused the question.
    pub fn refused(&self) {
        if !self.refused.swap(true, Relaxed) {
            tracing::warn!(
                "WAL invalidation: the server refused txid_current_if_assigned(); writes \
                 through pgmemo are bumped again by their WAL from now on"
            );
        }
    }

    /// Whether the WAL's transaction `xid` of `database` was noted (the note is taken).
    pub fn take(&self, database: &str, xid: u32) -> bool {
        self.take_since(database, xid, None)
    }

    /// [`OwnCommits::take`], for a note made at or after `since` only (one made before is
    /// taken and not counted: its commit is bumped again).
    pub fn take_since(&self, database: &str, xid: u32, since: Option<Instant>) -> bool {
        let notes = self.notes.pin();
        if notes.is_empty() {
            return false;
        }
        let taken = notes.remove(&(database.into(), xid)).is_some_and(|&noted| {
            noted.elapsed() < MAX_AGE && since.is_none_or(|since| noted >= since)
        });
        if taken {
            self.skipped.fetch_add(1, Relaxed);
        }
        taken
    }
}

/// The transaction ID in a DataRow of `txid_current_if_assigned()` (text: epoch × 2³² +
/// ID); None for NULL (the transaction wrote nothing) or anything else.
pub fn xid_in_data_row(body: &[u8]) -> Option<u64> {
    let columns = i16::from_be_bytes(body.get(..2)?.try_into().ok()?);
    let len = i32::from_be_bytes(body.get(2..6)?.try_into().ok()?);
    if columns != 1 || len < 0 || body.len() != 6 + len as usize {
        return None;
    }
    std::str::from_utf8(&body[6..]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_is_taken_once_and_only_for_its_database() {
        let own = OwnCommits::default();
        own.note("db", (3 << 32) | 734);
        assert!(!own.take("other", 734));
        assert!(!own.take("db", 735));
        assert!(own.take("db", 734));
        assert!(!own.take("db", 734));
        assert_eq!(own.skipped.load(Relaxed), 1);
    }

    #[test]
    fn notes_stay_bounded() {
        let own = OwnCommits::default();
        for xid in 0..(MAX_NOTES as u64 * 3) {
            own.note("db", xid);
        }
        assert!(own.notes.pin().len() <= MAX_NOTES);
    }

    #[test]
    fn reads_the_transaction_id() {
        let row = |v: &[u8]| {
            let mut b = 1i16.to_be_bytes().to_vec();
            b.extend((v.len() as i32).to_be_bytes());
            b.extend(v);
            b
        };
        assert_eq!(xid_in_data_row(&row(b"4294968030")), Some(4294968030));
        let mut null = 1i16.to_be_bytes().to_vec();
        null.extend((-1i32).to_be_bytes());
        assert_eq!(xid_in_data_row(&null), None);
        assert_eq!(xid_in_data_row(&row(b"x")), None);
        assert_eq!(xid_in_data_row(b"\0"), None);
    }
}
