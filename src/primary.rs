//! Which host of a server list is the primary, and when that changes (a switchover or a
//! failover).
//!
//! An upstream given as several hosts with `target_session_attrs=read-write` (or `primary`),
//! as libpq takes them, names a cluster: a primary and its standbys, whichever host is the
//! primary today. pgmemo does what libpq does for each new connection — tries the hosts in
//! order and keeps the first that is the primary — and remembers which host that was, here,
//! shared by every pool and WAL follower of those hosts. When a new connection lands on
//! another host than the last one did, the primary has moved (a standby was promoted): that
//! is a switchover, counted and logged, and from then on
//! - pooled servers of the old host are closed when next met (checked out or given back),
//!   never used again: the old primary may be a standby by now, or a server cut off from
//!   its standbys that should take no write;
//! - the database's WAL follower, whose stream came from the old host, is not served from
//!   and starts again on the new one; everything cached for the database is flushed (nobody
//!   can know what committed on the new primary before its stream started) and caching
//!   resumes once the new stream has caught up (see `wal`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// The primary of one server list (see the module's documentation).
#[derive(Debug, Default)]
pub struct Primary {
    /// The host the last connection that needed the primary used: its place in the list,
    /// plus one (0: none yet).
    host: AtomicUsize,
    /// How often that changed.
    switchovers: AtomicU64,
    /// Told at each switchover (the WAL follower waits on it).
    moved: tokio::sync::Notify,
}

impl Primary {
    /// A connection that needed the primary found it at `host` (its place in the list);
    /// whether that is a switchover.
    pub fn found_at(&self, host: usize) -> bool {
        let before = self.host.swap(host + 1, Relaxed);
        let moved = before != 0 && before != host + 1;
        if moved {
            self.switchovers.fetch_add(1, Relaxed);
            self.moved.notify_waiters();
        }
        moved
    }

    /// The primary's place in the list, when known.
    #[inline]
    pub fn host(&self) -> Option<usize> {
        self.host.load(Relaxed).checked_sub(1)
    }

    /// Whether a connection made to `host` is still on the primary as far as pgmemo knows.
    #[inline]
    pub fn is_at(&self, host: usize) -> bool {
        let known = self.host.load(Relaxed);
        known == 0 || known == host + 1
    }

    pub fn switchovers(&self) -> u64 {
        self.switchovers.load(Relaxed)
    }

    /// Resolves at the next switchover.
    pub async fn moved(&self) {
        self.moved.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_host_is_a_switchover() {
        let p = Primary::default();
        assert_eq!(p.host(), None);
        assert!(p.is_at(1), "nothing known yet");
        assert!(!p.found_at(1), "the first primary found");
        assert!(!p.found_at(1));
        assert!(p.is_at(1) && !p.is_at(0));
        assert!(p.found_at(0));
        assert_eq!((p.host(), p.switchovers()), (Some(0), 1));
        assert!(!p.is_at(1));
    }
}
