//! When a commit the WAL shows becomes a commit other sessions see.
//!
//! PostgreSQL writes and flushes a transaction's commit record, then (with synchronous
//! replication) waits for its standbys, and only then takes the transaction out of its
//! ProcArray, which is what makes it visible to snapshots taken afterwards. A logical
//! walsender decodes the commit as soon as the record is flushed: pgmemo's follower may know
//! of a write that no query can see yet, for as long as the standbys take to answer (and,
//! without them, for the microseconds before the ProcArray is updated). A result read in that
//! gap and stored under versions that include the commit would stay stale for good.
//!
//! So a decoded commit bumps what it wrote *unsettled* (see `cache::versions`: stale at once,
//! and nothing read meanwhile is stored) and waits here, with its transaction ID, until the
//! server shows it visible: a snapshot (`pg_current_snapshot()`) taken on an ordinary
//! connection after the decode in which the transaction is neither running nor in the
//! future. Snapshots taken later see it too (a transaction never goes back into the
//! ProcArray), so once settled, a read sent afterwards runs on a snapshot that includes it.
//! The follower's applied position (SHOW CACHE WAL, `cache.max_lag`, the catch-up at its
//! start) does not pass a commit before it is settled.
//!
//! Exact, not timed: how soon the server is asked again only decides how long the rows just
//! written go uncached.

use super::Lsn;
use crate::cache::versions::Versions;
use parking_lot::Mutex;
use std::collections::VecDeque;

/// What `pg_current_snapshot()` shows (`xmin:xmax:xip,...`, full transaction IDs): the
/// first ID not yet ended when it was taken, and the IDs running then.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerSnapshot {
    xmax: u64,
    running: Vec<u64>,
}

impl ServerSnapshot {
    pub fn parse(text: &str) -> Option<ServerSnapshot> {
        let mut parts = text.split(':');
        let xmin: u64 = parts.next()?.parse().ok()?;
        let xmax: u64 = parts.next()?.parse().ok()?;
        let running = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<Vec<u64>>>()?,
        };
        (parts.next().is_none() && xmin <= xmax).then_some(ServerSnapshot { xmax, running })
    }

    /// Whether the transaction `xid` (the low 32 bits the WAL names it by) had ended when
    /// the snapshot was taken: before its `xmax` (in the 2³¹ window PostgreSQL compares
    /// IDs in) and not running. Without an ID: only a snapshot in which nothing runs shows
    /// that every transaction decoded before it ended.
    pub fn shows(&self, xid: Option<u32>) -> bool {
        match xid {
            Some(xid) => {
                let precedes = (xid.wrapping_sub(self.xmax as u32) as i32) < 0;
                precedes && !self.running.iter().any(|&r| r as u32 == xid)
            }
            None => self.running.is_empty(),
        }
    }
}

/// One decoded commit not yet seen.
#[derive(Debug)]
struct Commit {
    xid: Option<u32>,
    /// The position applied before it: the follower's applied position stays there until
    /// it is settled.
    before: Lsn,
    /// The slots it bumped unsettled.
    slots: Vec<u32>,
    /// What the fleet's stream tells of it once seen (the leader's, see `super::fleet`).
    published: Option<super::fleet::Commit>,
}

/// A follower's decoded commits waiting to be seen, and the positions it has reached.
#[derive(Debug, Default)]
pub struct Progress {
    state: Mutex<State>,
    /// A commit was decoded: the settling loop asks the server.
    pub decoded_commit: tokio::sync::Notify,
    /// A commit was seen: a fleet's leader publishes it (see [`Progress::take_seen`]).
    pub seen_commit: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct State {
    /// In WAL order.
    unsettled: VecDeque<Commit>,
    /// Everything up to here is decoded.
    decoded: Lsn,
    /// The server's end of WAL as last reported.
    server_end: Lsn,
    /// Commits seen whose [`super::fleet::Commit`] the leader has yet to publish.
    outbox: Vec<super::fleet::Commit>,
}

impl Progress {
    /// A commit of `xid` decoded at `before` wrote `slots`: bumped now, settled when seen
    /// (and then, for a fleet's leader, `published`: see [`Progress::take_seen`]).
    pub fn decoded(
        &self,
        versions: &Versions,
        (xid, before): (Option<u32>, Lsn),
        slots: Vec<u32>,
        published: Option<super::fleet::Commit>,
    ) {
        let mut state = self.state.lock();
        versions.bump_unsettled(&slots);
        state.unsettled.push_back(Commit {
            xid,
            before,
            slots,
            published,
        });
        drop(state);
        self.decoded_commit.notify_one();
    }

    /// The stream is decoded up to `decoded`; the server's WAL ends at `server_end`.
    pub fn decoded_to(&self, decoded: Lsn, server_end: Lsn) {
        let mut state = self.state.lock();
        state.decoded = state.decoded.max(decoded);
        state.server_end = state.server_end.max(server_end);
    }

    /// (applied, the server's end of WAL): applied is the decoded position, held before the
    /// first commit not yet seen.
    pub fn applied(&self) -> (Lsn, Lsn) {
        let state = self.state.lock();
        let applied = state.unsettled.front().map_or(state.decoded, |c| c.before);
        (applied, state.server_end)
    }

    pub fn is_settled(&self) -> bool {
        self.state.lock().unsettled.is_empty()
    }

    /// Settles every commit `snapshot` shows; how many.
    pub fn settle_shown(&self, versions: &Versions, snapshot: &ServerSnapshot) -> usize {
        let mut state = self.state.lock();
        let State {
            unsettled, outbox, ..
        } = &mut *state;
        let before = unsettled.len();
        unsettled.retain_mut(|c| {
            let shown = snapshot.shows(c.xid);
            if shown {
                versions.settle(&c.slots);
                outbox.extend(c.published.take());
            }
            !shown
        });
        before - unsettled.len()
    }

    /// The commits seen since the last call, for the fleet's stream: taken before the
    /// applied position they let pass is published ([`super::Follower::publish`]), so a
    /// reader of the stream has every commit up to a position before it reads the position.
    pub fn take_seen(&self) -> Vec<super::fleet::Commit> {
        std::mem::take(&mut self.state.lock().outbox)
    }

    /// The stream ended and what it guarded was flushed (the caller's duty, first): every
    /// commit is settled and the positions start again.
    pub fn settle_all(&self, versions: &Versions) {
        let mut state = self.state.lock();
        for c in state.unsettled.drain(..) {
            versions.settle(&c.slots);
        }
        *state = State::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::versions::Seen;

    #[test]
    fn reads_the_servers_snapshot() {
        let s = ServerSnapshot::parse("740:745:740,742").unwrap();
        assert_eq!(s.xmax, 745);
        assert_eq!(s.running, [740, 742]);
        assert!(s.shows(Some(741)) && s.shows(Some(739)));
        assert!(!s.shows(Some(740)), "running");
        assert!(!s.shows(Some(745)) && !s.shows(Some(800)), "not ended yet");
        assert!(!s.shows(None), "something runs");
        assert!(ServerSnapshot::parse("745:745:").unwrap().shows(None));
        for bad in ["", "1:2", "2:1:", "1:2:x", "1:2:3:4", "a:b:"] {
            assert_eq!(ServerSnapshot::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn ids_compare_across_the_32_bit_wrap() {
        // Epoch 1, xmax just past the wrap: an ID decoded from before it is in the past.
        let s = ServerSnapshot::parse(&format!("{0}:{0}:", (1u64 << 32) + 5)).unwrap();
        assert!(s.shows(Some(u32::MAX - 10)));
        assert!(s.shows(Some(4)));
        assert!(!s.shows(Some(5)) && !s.shows(Some(6)));
    }

    #[test]
    fn the_applied_position_waits_for_the_first_commit_not_seen() {
        let (versions, progress) = (Versions::new(4), Progress::default());
        let t = versions.table_slot("db", "t");
        progress.decoded_to(Lsn(10), Lsn(10));
        progress.decoded(&versions, (Some(100), Lsn(10)), vec![t], None);
        progress.decoded_to(Lsn(20), Lsn(20));
        progress.decoded(&versions, (Some(101), Lsn(20)), vec![t], None);
        progress.decoded_to(Lsn(30), Lsn(30));
        assert_eq!(progress.applied(), (Lsn(10), Lsn(30)));
        // 101 ended, 100 still runs (its standby has not answered).
        let snapshot = ServerSnapshot::parse("100:102:100").unwrap();
        assert_eq!(progress.settle_shown(&versions, &snapshot), 1);
        assert_eq!(progress.applied(), (Lsn(10), Lsn(30)));
        assert!(!versions.unchanged(&versions.capture(&[t], Seen::default())));
        let snapshot = ServerSnapshot::parse("102:102:").unwrap();
        assert_eq!(progress.settle_shown(&versions, &snapshot), 1);
        assert_eq!(progress.applied(), (Lsn(30), Lsn(30)));
        assert!(progress.is_settled());
        assert!(versions.unchanged(&versions.capture(&[t], Seen::default())));
    }

    #[test]
    fn an_ended_stream_settles_everything() {
        let (versions, progress) = (Versions::new(4), Progress::default());
        let t = versions.table_slot("db", "t");
        progress.decoded(&versions, (None, Lsn(1)), vec![t], None);
        progress.settle_all(&versions);
        assert!(progress.is_settled());
        assert_eq!(progress.applied(), (Lsn(0), Lsn(0)));
        assert!(versions.unchanged(&versions.capture(&[t], Seen::default())));
    }
}
