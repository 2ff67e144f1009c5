//! Counters per pool, as PgBouncer's SHOW STATS reports them.
//!
//! Sessions count into plain local fields during a transaction and add them here once, when the
//! transaction ends, so the hot path does one batch of relaxed atomic adds per transaction and
//! never takes a lock or sends a message for statistics.

use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds, in microseconds, of the duration histograms' buckets (Prometheus `le`, in
/// seconds); one more bucket counts the rest (`+Inf`).
pub const DURATION_BUCKETS_US: [u64; 14] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
    2_500_000, 10_000_000,
];

/// A histogram of durations: a relaxed atomic add per bucket and one for the sum per
/// observation, no lock.
#[derive(Default, Debug)]
pub struct DurationHistogram {
    /// Observations per bucket (not cumulative), the last for those over every bound.
    buckets: [AtomicU64; DURATION_BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
}

impl DurationHistogram {
    #[inline]
    pub fn observe_us(&self, us: u64) {
        let bucket = DURATION_BUCKETS_US.partition_point(|&bound| bound < us);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        if us != 0 {
            self.sum_us.fetch_add(us, Ordering::Relaxed);
        }
    }

    /// The cumulative count of each bucket (the last is every observation), and the sum in
    /// microseconds.
    pub fn cumulative(&self) -> ([u64; DURATION_BUCKETS_US.len() + 1], u64) {
        let mut total = 0;
        let counts = std::array::from_fn(|i| {
            total += self.buckets[i].load(Ordering::Relaxed);
            total
        });
        (counts, self.sum_us.load(Ordering::Relaxed))
    }
}

/// A counter that several workers add to at once, each into a cache line of its own (a line
/// written by two cores travels between them on every write: see workers.rs); summed when
/// read.
#[derive(Default, Debug)]
pub struct StripedCounter([Stripe; STRIPES]);

/// One worker's part of a [`StripedCounter`], alone in its cache line (and the next one,
/// which x86's adjacent-line prefetch pairs with it).
#[derive(Default, Debug)]
#[repr(align(128))]
struct Stripe(AtomicU64);

/// Workers beyond this many share stripes.
const STRIPES: usize = 4;

impl StripedCounter {
    #[inline]
    pub fn add(&self, n: u64) {
        let stripe = crate::workers::current() as usize % STRIPES;
        self.0[stripe].0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.iter().map(|s| s.0.load(Ordering::Relaxed)).sum()
    }
}

#[derive(Default, Debug)]
pub struct PoolStats {
    /// How long each transaction held its server (one observation per transaction; in
    /// transaction mode each query outside a block is one).
    pub xact_duration: DurationHistogram,
    /// How long each checkout waited for a server (0 when one was idle).
    pub wait_duration: DurationHistogram,
    pub xact_count: AtomicU64,
    pub query_count: AtomicU64,
    pub bytes_received: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub xact_time_us: AtomicU64,
    pub query_time_us: AtomicU64,
    pub wait_time_us: AtomicU64,
    pub wait_timeouts: AtomicU64,
    pub client_logins: AtomicU64,
    pub server_connects: AtomicU64,
    /// Bind/Describe of a statement the server already had.
    pub prepare_cache_hit: AtomicU64,
    /// Statements that had to be parsed on the server (first Parse, or injected).
    pub prepare_cache_miss: AtomicU64,
    /// Statements closed on a server to keep it within max_prepared_statements.
    pub prepare_evictions: AtomicU64,
    /// Simple queries run as autoprepared statements.
    pub autoprepared: AtomicU64,
    /// Simple queries of clients with autoprepare on that went to the server as they were.
    pub autoprepare_passed: AtomicU64,
    /// Servers asked what a client's transaction left in its session (`session::state`).
    pub state_probes: AtomicU64,
    /// Batches of Parse / Describe / Close up to a Sync or Flush answered without a server
    /// (`statements::idle_batch`).
    pub serverless_batches: AtomicU64,
    /// Server connections handed to a client on another worker than the one they served
    /// last, and moved to it (see workers.rs).
    pub server_moves: AtomicU64,
    /// Client sessions moved between transactions to the worker of the CPU their client
    /// sends from (see workers.rs).
    pub client_moves: AtomicU64,
    /// Clients pinned to their server, by reason (in `session::state::Pins::ALL`'s order),
    /// counted when the reason appears.
    pub pins: [AtomicU64; 5],
}

/// What one session counted since it last reported.
#[derive(Default, Debug, Clone, Copy)]
pub struct LocalStats {
    pub xact_count: u64,
    pub query_count: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub xact_time_us: u64,
    pub query_time_us: u64,
    pub prepare_cache_hit: u64,
    pub prepare_cache_miss: u64,
    pub prepare_evictions: u64,
    pub autoprepared: u64,
    pub autoprepare_passed: u64,
}

impl PoolStats {
    pub fn add(&self, local: &mut LocalStats) {
        let r = Ordering::Relaxed;
        self.xact_count.fetch_add(local.xact_count, r);
        self.query_count.fetch_add(local.query_count, r);
        self.bytes_received.fetch_add(local.bytes_received, r);
        self.bytes_sent.fetch_add(local.bytes_sent, r);
        self.xact_time_us.fetch_add(local.xact_time_us, r);
        self.query_time_us.fetch_add(local.query_time_us, r);
        if local.prepare_cache_hit | local.prepare_cache_miss | local.prepare_evictions != 0 {
            self.prepare_cache_hit.fetch_add(local.prepare_cache_hit, r);
            self.prepare_cache_miss
                .fetch_add(local.prepare_cache_miss, r);
            self.prepare_evictions.fetch_add(local.prepare_evictions, r);
        }
        if local.autoprepared | local.autoprepare_passed != 0 {
            self.autoprepared.fetch_add(local.autoprepared, r);
            self.autoprepare_passed
                .fetch_add(local.autoprepare_passed, r);
        }
        *local = LocalStats::default();
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let r = Ordering::Relaxed;
        StatsSnapshot {
            xact_count: self.xact_count.load(r),
            query_count: self.query_count.load(r),
            bytes_received: self.bytes_received.load(r),
            bytes_sent: self.bytes_sent.load(r),
            xact_time_us: self.xact_time_us.load(r),
            query_time_us: self.query_time_us.load(r),
            wait_time_us: self.wait_time_us.load(r),
            wait_timeouts: self.wait_timeouts.load(r),
            client_logins: self.client_logins.load(r),
            server_connects: self.server_connects.load(r),
            prepare_cache_hit: self.prepare_cache_hit.load(r),
            prepare_cache_miss: self.prepare_cache_miss.load(r),
            prepare_evictions: self.prepare_evictions.load(r),
            autoprepared: self.autoprepared.load(r),
            autoprepare_passed: self.autoprepare_passed.load(r),
            state_probes: self.state_probes.load(r),
            serverless_batches: self.serverless_batches.load(r),
            server_moves: self.server_moves.load(r),
            client_moves: self.client_moves.load(r),
            pins: std::array::from_fn(|i| self.pins[i].load(r)),
        }
    }

    /// Counts the pin reasons in `new` (a set of `session::state::Pins` bits).
    pub fn count_pins(&self, new: u8) {
        for (i, (bit, _)) in crate::session::state::Pins::ALL.iter().enumerate() {
            if new & bit != 0 {
                self.pins[i].fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[derive(Default, Debug, Clone, Copy)]
pub struct StatsSnapshot {
    pub xact_count: u64,
    pub query_count: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub xact_time_us: u64,
    pub query_time_us: u64,
    pub wait_time_us: u64,
    pub wait_timeouts: u64,
    pub client_logins: u64,
    pub server_connects: u64,
    pub prepare_cache_hit: u64,
    pub prepare_cache_miss: u64,
    pub prepare_evictions: u64,
    pub autoprepared: u64,
    pub autoprepare_passed: u64,
    pub state_probes: u64,
    pub serverless_batches: u64,
    pub server_moves: u64,
    pub client_moves: u64,
    pub pins: [u64; 5],
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_striped_counter_sums_its_stripes() {
        let c = StripedCounter::default();
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| (0..1000).for_each(|_| c.add(1)));
            }
        });
        c.add(5);
        assert_eq!(c.get(), 3005);
        assert_eq!(
            std::mem::align_of::<Stripe>(),
            128,
            "a stripe per cache-line pair"
        );
    }
}
