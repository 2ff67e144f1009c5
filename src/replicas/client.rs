//! One client's reads: which replica its held server is on, and the WAL positions its reads
//! must see (read-your-writes, monotonic reads, causal reads).

use std::sync::Arc;

use super::{Replica, Replicas};

/// The per-client state of the replica feature (a client of a pool that has replicas, in
/// transaction mode).
pub struct ClientReads {
    pub set: Arc<Replicas>,
    /// The replica the server held now is on (None: the primary's, or none held).
    pub on: Option<Arc<Replica>>,
    /// The server held is `on`'s for a read-only transaction block (see
    /// `Session::acquire_replica`): everything the client sends goes there until it ends.
    pub block: bool,
    /// The replica the client's last read went to: its next reads go there while it can
    /// take them, so that they never see an older state than the last one did.
    pub last: Option<Arc<Replica>>,
    /// The WAL position the client's last write committed at (or past it): read-your-writes.
    pub committed: u64,
    /// The highest replay position a replica was known to have when one of the client's
    /// reads went to it: a read that moves to another replica must see at least that
    /// (monotonic reads).
    pub seen: u64,
    /// Work sent to the primary on the server held now that is not proven read-only: its
    /// commit position is asked for before the server goes back.
    pub wrote: bool,
    /// That work named `synchronous_commit` (or called a function by OID): its commit may
    /// not be flushed when it returns (see [`super::lsn::commit_position`]).
    pub maybe_async: bool,
    /// A question for the primary's position is in flight, sent behind the client's unit of
    /// work (see `Session::ask_position`).
    pub asked: bool,
    /// That work may start a COPY FROM STDIN (it names `copy`): nothing may be sent behind
    /// it, the position is asked once the server is idle instead.
    pub no_pipelining: bool,
    /// The last question for a commit position failed: the floor is not known (reads go to
    /// the primary) until the next one, asked after the client's next work on the primary.
    pub unsure: bool,
    /// The floor last reported to the client (`pgmemo.report_read_lsn`, see
    /// `Session::report_read_lsn`): 0 before the first report.
    pub reported: u64,
}

impl ClientReads {
    pub fn new(set: Arc<Replicas>) -> Box<ClientReads> {
        Box::new(ClientReads {
            set,
            on: None,
            block: false,
            last: None,
            committed: 0,
            seen: 0,
            wrote: false,
            maybe_async: false,
            asked: false,
            no_pipelining: false,
            unsure: false,
            reported: 0,
        })
    }

    /// The position a read of this client must see: its own writes', what it read before
    /// (on its last replica: as far as that one is known to have replayed by now, the most
    /// it can have shown), and `min_read_lsn` (the client's `pgmemo.min_read_lsn`, a causal
    /// floor it was given).
    pub fn floor(&self, min_read_lsn: Option<&str>) -> u64 {
        if self.unsure {
            return u64::MAX;
        }
        let given = min_read_lsn.and_then(super::lsn::parse).unwrap_or(0);
        let last = self.last.as_ref().map_or(0, |l| l.replayed());
        self.committed.max(self.seen).max(given).max(last)
    }

    /// The primary's position after the client's work is known: `at` (None: the question
    /// failed, the floor is unknown until the next one).
    pub fn learnt(&mut self, at: Option<u64>) {
        match at {
            Some(at) => {
                self.committed = self.committed.max(at);
                self.unsure = false;
                self.wrote = false;
                self.maybe_async = false;
                self.no_pipelining = false;
                self.set.note_primary(at, self.set.now_us());
            }
            None => self.unsure = true,
        }
    }

    /// A read of the client goes to `replica`, known to have replayed `replayed`.
    pub fn read_on(&mut self, replica: &Arc<Replica>, replayed: u64) {
        self.seen = self.seen.max(replayed);
        self.last = Some(replica.clone());
        self.on = Some(replica.clone());
        replica
            .reads
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}
