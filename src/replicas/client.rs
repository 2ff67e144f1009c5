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
    /// Work sent to the primary on the server held now that is not proven read-only, and not
    /// yet covered by a question for the primary's position: its commit position is asked
    /// for before the server goes back.
    pub wrote: bool,
    /// That work named `synchronous_commit` (or called a function by OID): its commit may
    /// not be flushed when it returns (see [`crate::lsn::commit_position`]).
    pub maybe_async: bool,
    /// A question for the primary's position is in flight, sent behind the client's unit of
    /// work (see `Session::ask_position`). The work it covers is no longer `wrote`: work the
    /// client sends behind the question is (see [`ClientReads::asking`]).
    pub asked: bool,
    /// The question in flight covers work that named `synchronous_commit`.
    pub asked_async: bool,
    /// The question in flight was answered with a position its work committed at or before.
    pub answered: bool,
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
            asked_async: false,
            answered: false,
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
        let given = min_read_lsn.and_then(crate::lsn::parse).unwrap_or(0);
        let last = self.last.as_ref().map_or(0, |l| l.replayed());
        self.committed.max(self.seen).max(given).max(last)
    }

    /// The primary's position after all the client's work on the server held is known, the
    /// server idle: `at` (None: the question failed, the floor is unknown until the next one).
    pub fn learnt(&mut self, at: Option<u64>) {
        if self.raise(at) {
            self.wrote = false;
            self.maybe_async = false;
            self.no_pipelining = false;
        }
    }

    /// A question for the primary's position goes behind the client's work: that work is
    /// covered by it, and what the client sends behind it is new work, which may write after
    /// the position the question gets (it is asked for again).
    pub fn asking(&mut self) {
        self.asked = true;
        self.answered = false;
        self.asked_async = std::mem::take(&mut self.maybe_async);
        self.wrote = false;
    }

    /// The row of the question in flight: `at` (None: no position it says the work committed
    /// at or before).
    pub fn answer(&mut self, at: Option<u64>) {
        self.answered = self.raise(at);
    }

    /// The question in flight ended (its ReadyForQuery). Unanswered (it failed, or the
    /// client's transaction went on), the work it was to cover is the client's again: its
    /// position is asked for once the server is idle.
    pub fn question_ended(&mut self) {
        self.asked = false;
        if !std::mem::take(&mut self.answered) {
            self.wrote = true;
            self.maybe_async |= self.asked_async;
        }
    }

    /// The floor raised to `at`, the primary's position past the client's work (None: the
    /// floor is unknown). Returns whether it was known.
    fn raise(&mut self, at: Option<u64>) -> bool {
        let Some(at) = at else {
            self.unsure = true;
            return false;
        };
        self.committed = self.committed.max(at);
        self.unsure = false;
        self.set.note_primary(at, self.set.now_us());
        true
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
