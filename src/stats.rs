//! Counters per pool, as PgBouncer's SHOW STATS reports them.
//!
//! Sessions count into plain local fields during a transaction and add them here once, when the
//! transaction ends, so the hot path does one batch of relaxed atomic adds per transaction and
//! never takes a lock or sends a message for statistics; each worker adds to counters of its
//! own (`PoolStripe`), summed when read.

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

/// The latest durations observed (microseconds, a ring of [`SAMPLES`]), for percentiles: how
/// long WAL invalidation took (SHOW CACHE WAL), the shared tier's round trips.
#[derive(Debug, Default)]
pub struct Samples {
    recent: Vec<u64>,
    next: usize,
}

const SAMPLES: usize = 1024;

impl Samples {
    pub fn add(&mut self, us: u64) {
        if self.recent.len() < SAMPLES {
            self.recent.push(us);
        } else {
            self.recent[self.next] = us;
        }
        self.next = (self.next + 1) % SAMPLES;
    }

    /// (p50, p99) in microseconds.
    pub fn percentiles(&self) -> Option<(u64, u64)> {
        if self.recent.is_empty() {
            return None;
        }
        let mut sorted = self.recent.clone();
        sorted.sort_unstable();
        let at = |p: f64| sorted[((sorted.len() - 1) as f64 * p).round() as usize];
        Some((at(0.5), at(0.99)))
    }
}

pub use crate::workers::StripedCounter;
use crate::workers::{this_stripe, STRIPES};

/// A pool's counters, one [`PoolStripe`] per worker (see workers.rs): every transaction adds
/// to them, and a cache line that two cores write travels between them on every write.
/// Readers sum the stripes.
#[derive(Default, Debug)]
pub struct PoolStats {
    stripes: [PoolStripe; STRIPES],
}

/// The counters one worker adds to, in cache lines of their own.
#[derive(Default, Debug)]
#[repr(align(128))]
pub struct PoolStripe {
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
    /// Server connections opened (logged in).
    pub server_connects: AtomicU64,
    /// Attempts to open a server connection that failed (refused, timed out, login failed).
    pub server_connect_failures: AtomicU64,
    /// Parse messages of named statements from clients (PgBouncer's `client_parse_count`).
    pub client_parses: AtomicU64,
    /// Bind messages of named statements from clients (PgBouncer's `bind_count`).
    pub binds: AtomicU64,
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
    /// Clients pinned to their server, by reason (in `pins::Pins::ALL`'s order),
    /// counted when the reason appears.
    pub pins: [AtomicU64; crate::pins::Pins::ALL.len()],
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
    // Rarer events, each at most a few per statement between two reports (a server's
    // release, in transaction mode): 32 bits, which keep `Session` in its allocator size
    // class (see session/tests.rs).
    pub prepare_cache_miss: u32,
    pub prepare_evictions: u32,
    pub autoprepared: u32,
    pub autoprepare_passed: u32,
}

impl PoolStats {
    /// The current worker's counters, to add to.
    #[inline]
    pub fn here(&self) -> &PoolStripe {
        &self.stripes[this_stripe()]
    }

    /// Adds what a session counted, and zeroes it.
    #[inline]
    pub fn add(&self, local: &mut LocalStats) {
        self.here().add(local)
    }

    /// Counts the pin reasons in `new` (a set of `pins::Pins` bits).
    pub fn count_pins(&self, new: u8) {
        let here = self.here();
        for (i, (bit, _)) in crate::pins::Pins::ALL.iter().enumerate() {
            if new & bit != 0 {
                here.pins[i].fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Every counter, summed over the workers.
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut total = StatsSnapshot::default();
        for stripe in &self.stripes {
            stripe.add_to(&mut total);
        }
        total
    }

    /// [`DurationHistogram::cumulative`] of the transaction durations, over the workers.
    pub fn xact_durations(&self) -> ([u64; DURATION_BUCKETS_US.len() + 1], u64) {
        self.histogram(|s| &s.xact_duration)
    }

    /// [`DurationHistogram::cumulative`] of the checkout waits, over the workers.
    pub fn wait_durations(&self) -> ([u64; DURATION_BUCKETS_US.len() + 1], u64) {
        self.histogram(|s| &s.wait_duration)
    }

    fn histogram(
        &self,
        of: impl Fn(&PoolStripe) -> &DurationHistogram,
    ) -> ([u64; DURATION_BUCKETS_US.len() + 1], u64) {
        let mut total = ([0; DURATION_BUCKETS_US.len() + 1], 0);
        for stripe in &self.stripes {
            let (counts, sum) = of(stripe).cumulative();
            total.0.iter_mut().zip(counts).for_each(|(t, n)| *t += n);
            total.1 += sum;
        }
        total
    }
}

impl PoolStripe {
    fn add(&self, local: &mut LocalStats) {
        let r = Ordering::Relaxed;
        self.xact_count.fetch_add(local.xact_count, r);
        self.query_count.fetch_add(local.query_count, r);
        self.bytes_received.fetch_add(local.bytes_received, r);
        self.bytes_sent.fetch_add(local.bytes_sent, r);
        self.xact_time_us.fetch_add(local.xact_time_us, r);
        self.query_time_us.fetch_add(local.query_time_us, r);
        if local.prepare_cache_hit | u64::from(local.prepare_cache_miss | local.prepare_evictions)
            != 0
        {
            self.prepare_cache_hit.fetch_add(local.prepare_cache_hit, r);
            self.prepare_cache_miss
                .fetch_add(u64::from(local.prepare_cache_miss), r);
            self.prepare_evictions
                .fetch_add(u64::from(local.prepare_evictions), r);
        }
        if local.autoprepared | local.autoprepare_passed != 0 {
            self.autoprepared
                .fetch_add(u64::from(local.autoprepared), r);
            self.autoprepare_passed
                .fetch_add(u64::from(local.autoprepare_passed), r);
        }
        *local = LocalStats::default();
    }

    fn add_to(&self, t: &mut StatsSnapshot) {
        let r = Ordering::Relaxed;
        t.xact_count += self.xact_count.load(r);
        t.query_count += self.query_count.load(r);
        t.bytes_received += self.bytes_received.load(r);
        t.bytes_sent += self.bytes_sent.load(r);
        t.xact_time_us += self.xact_time_us.load(r);
        t.query_time_us += self.query_time_us.load(r);
        t.wait_time_us += self.wait_time_us.load(r);
        t.wait_timeouts += self.wait_timeouts.load(r);
        t.client_logins += self.client_logins.load(r);
        t.server_connects += self.server_connects.load(r);
        t.server_connect_failures += self.server_connect_failures.load(r);
        // Every checkout observes its wait once: PgBouncer's server_assignment_count.
        t.server_assignments += self.wait_duration.cumulative().0[DURATION_BUCKETS_US.len()];
        t.client_parses += self.client_parses.load(r);
        t.binds += self.binds.load(r);
        t.prepare_cache_hit += self.prepare_cache_hit.load(r);
        t.prepare_cache_miss += self.prepare_cache_miss.load(r);
        t.prepare_evictions += self.prepare_evictions.load(r);
        t.autoprepared += self.autoprepared.load(r);
        t.autoprepare_passed += self.autoprepare_passed.load(r);
        t.state_probes += self.state_probes.load(r);
        t.serverless_batches += self.serverless_batches.load(r);
        t.server_moves += self.server_moves.load(r);
        t.client_moves += self.client_moves.load(r);
        for (total, n) in t.pins.iter_mut().zip(&self.pins) {
            *total += n.load(r);
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
    pub server_connect_failures: u64,
    /// Times a server was handed to a client (PgBouncer's `server_assignment_count`): the
    /// checkouts, as counted by the wait-time histogram.
    pub server_assignments: u64,
    pub client_parses: u64,
    pub binds: u64,
    pub prepare_cache_hit: u64,
    pub prepare_cache_miss: u64,
    pub prepare_evictions: u64,
    pub autoprepared: u64,
    pub autoprepare_passed: u64,
    pub state_probes: u64,
    pub serverless_batches: u64,
    pub server_moves: u64,
    pub client_moves: u64,
    pub pins: [u64; crate::pins::Pins::ALL.len()],
}

impl StatsSnapshot {
    /// Adds `o`'s counts (a database's pools summed, SHOW STATS; every pool, SHOW TOTALS).
    pub fn add(&mut self, o: &StatsSnapshot) {
        let StatsSnapshot {
            xact_count,
            query_count,
            bytes_received,
            bytes_sent,
            xact_time_us,
            query_time_us,
            wait_time_us,
            wait_timeouts,
            client_logins,
            server_connects,
            server_connect_failures,
            server_assignments,
            client_parses,
            binds,
            prepare_cache_hit,
            prepare_cache_miss,
            prepare_evictions,
            autoprepared,
            autoprepare_passed,
            state_probes,
            serverless_batches,
            server_moves,
            client_moves,
            pins,
        } = o;
        self.xact_count += xact_count;
        self.query_count += query_count;
        self.bytes_received += bytes_received;
        self.bytes_sent += bytes_sent;
        self.xact_time_us += xact_time_us;
        self.query_time_us += query_time_us;
        self.wait_time_us += wait_time_us;
        self.wait_timeouts += wait_timeouts;
        self.client_logins += client_logins;
        self.server_connects += server_connects;
        self.server_connect_failures += server_connect_failures;
        self.server_assignments += server_assignments;
        self.client_parses += client_parses;
        self.binds += binds;
        self.prepare_cache_hit += prepare_cache_hit;
        self.prepare_cache_miss += prepare_cache_miss;
        self.prepare_evictions += prepare_evictions;
        self.autoprepared += autoprepared;
        self.autoprepare_passed += autoprepare_passed;
        self.state_probes += state_probes;
        self.serverless_batches += serverless_batches;
        self.server_moves += server_moves;
        self.client_moves += client_moves;
        for (total, n) in self.pins.iter_mut().zip(pins) {
            *total += n;
        }
    }
}

/// Why a client's login failed: the `reason` label of `pgmemo_client_login_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoginFailure {
    /// A wrong password (28P01).
    Password,
    /// Not allowed in: an unknown user, a TLS requirement, no admin user of the console
    /// (28000).
    Authorization,
    /// A database pgmemo does not serve (3D000).
    UnknownDatabase,
    /// A database the console's DISABLE closed.
    DatabaseDisabled,
    /// A malformed or unsupported startup (08P01, 0A000).
    Protocol,
    /// No login within client_login_timeout.
    Timeout,
    /// Turned away while pgmemo shuts down.
    ShuttingDown,
    /// The server the login needed refused it (or the client's startup parameters) or could
    /// not be reached.
    Server,
    /// Anything else.
    Other,
}

impl LoginFailure {
    pub const ALL: [LoginFailure; 9] = [
        LoginFailure::Password,
        LoginFailure::Authorization,
        LoginFailure::UnknownDatabase,
        LoginFailure::DatabaseDisabled,
        LoginFailure::Protocol,
        LoginFailure::Timeout,
        LoginFailure::ShuttingDown,
        LoginFailure::Server,
        LoginFailure::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LoginFailure::Password => "password",
            LoginFailure::Authorization => "authorization",
            LoginFailure::UnknownDatabase => "unknown_database",
            LoginFailure::DatabaseDisabled => "database_disabled",
            LoginFailure::Protocol => "protocol",
            LoginFailure::Timeout => "timeout",
            LoginFailure::ShuttingDown => "shutting_down",
            LoginFailure::Server => "server",
            LoginFailure::Other => "other",
        }
    }

    /// The reason for a login refused with SQLSTATE `code`.
    pub fn of_code(code: &str) -> LoginFailure {
        use crate::protocol::backend::sqlstate;
        match code {
            sqlstate::INVALID_PASSWORD => LoginFailure::Password,
            sqlstate::INVALID_AUTHORIZATION => LoginFailure::Authorization,
            sqlstate::INVALID_CATALOG_NAME => LoginFailure::UnknownDatabase,
            sqlstate::PROTOCOL_VIOLATION | sqlstate::FEATURE_NOT_SUPPORTED => {
                LoginFailure::Protocol
            }
            _ => LoginFailure::Other,
        }
    }
}

/// Errors that belong to no pool, for `/metrics`: counted where they happen (rare paths,
/// never the relay's).
#[derive(Default, Debug)]
pub struct ErrorCounters {
    /// Failed client logins, by [`LoginFailure`] (in `LoginFailure::ALL`'s order).
    login_failures: [AtomicU64; LoginFailure::ALL.len()],
    /// Clients turned away because max_client_conn clients were connected.
    pub max_client_conn: AtomicU64,
}

impl ErrorCounters {
    pub fn login_failed(&self, why: LoginFailure) {
        let i = LoginFailure::ALL
            .iter()
            .position(|&w| w == why)
            .unwrap_or(0);
        self.login_failures[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Each reason and its count.
    pub fn login_failures(&self) -> impl Iterator<Item = (LoginFailure, u64)> + '_ {
        LoginFailure::ALL
            .iter()
            .zip(&self.login_failures)
            .map(|(&why, n)| (why, n.load(Ordering::Relaxed)))
    }
}

/// The totals at the last two boundaries of PgBouncer's `stats_period`: SHOW STATS' averages
/// are taken from the older one to now, over one to two periods, so they describe the last
/// minute or two rather than the whole uptime. Rolled by the janitor.
#[derive(Debug)]
pub struct StatsPeriods {
    /// (older boundary, newer boundary), each with the totals then.
    boundaries: parking_lot::Mutex<[(std::time::Instant, StatsSnapshot); 2]>,
}

impl StatsPeriods {
    pub fn new(now: std::time::Instant) -> Self {
        StatsPeriods {
            boundaries: parking_lot::Mutex::new([(now, StatsSnapshot::default()); 2]),
        }
    }

    /// Starts a new period when the current one has lasted `period`, with the totals
    /// `totals` gives (read only then); true when it did.
    pub fn roll(
        &self,
        now: std::time::Instant,
        period: std::time::Duration,
        totals: impl FnOnce() -> StatsSnapshot,
    ) -> bool {
        let mut b = self.boundaries.lock();
        let due = now.saturating_duration_since(b[1].0) >= period;
        if due {
            b[0] = b[1];
            b[1] = (now, totals());
        }
        due
    }

    /// The last whole period's line (see [`stats_line`]): PgBouncer's `log_stats`.
    pub fn last_line(&self) -> String {
        let [(from, then), (to, now)] = *self.boundaries.lock();
        stats_line(&now, &then, to.saturating_duration_since(from))
    }

    /// The older boundary: when, and the totals then.
    pub fn since(&self) -> (std::time::Instant, StatsSnapshot) {
        self.boundaries.lock()[0]
    }
}

/// PgBouncer's stats line for the totals `now` that were `then`, `elapsed` ago: counts and
/// bytes per second, transaction and query time per transaction and query, wait time per
/// server assignment (µs). A pool that went meanwhile counts as nothing rather than less.
fn stats_line(now: &StatsSnapshot, then: &StatsSnapshot, elapsed: std::time::Duration) -> String {
    let us = elapsed.as_micros().max(1) as u64;
    let delta = |f: fn(&StatsSnapshot) -> u64| f(now).saturating_sub(f(then));
    let rate = |f: fn(&StatsSnapshot) -> u64| delta(f).saturating_mul(1_000_000) / us;
    let per = |total: u64, n: u64| total.checked_div(n).unwrap_or(0);
    format!(
        "stats: {} xacts/s, {} queries/s, {} client parses/s, {} server parses/s, {} binds/s, \
         in {} B/s, out {} B/s, xact {} us, query {} us, wait {} us",
        rate(|s| s.xact_count),
        rate(|s| s.query_count),
        rate(|s| s.client_parses),
        rate(|s| s.prepare_cache_miss),
        rate(|s| s.binds),
        rate(|s| s.bytes_received),
        rate(|s| s.bytes_sent),
        per(delta(|s| s.xact_time_us), delta(|s| s.xact_count)),
        per(delta(|s| s.query_time_us), delta(|s| s.query_count)),
        per(delta(|s| s.wait_time_us), delta(|s| s.server_assignments)),
    )
}

#[cfg(test)]
mod tests {

    #[test]
    fn sample_percentiles() {
        let mut lags = Samples::default();
        assert_eq!(lags.percentiles(), None);
        for us in 1..=100 {
            lags.add(us);
        }
        assert_eq!(lags.percentiles(), Some((51, 99)));
        for _ in 0..SAMPLES {
            lags.add(7);
        }
        assert_eq!(lags.percentiles(), Some((7, 7)));
    }

    use super::*;

    #[test]
    fn the_stats_line_is_pgbouncers_over_one_period() {
        let t0 = std::time::Instant::now();
        let period = std::time::Duration::from_secs(60);
        let log = StatsPeriods::new(t0 - period);
        let mut totals = StatsSnapshot {
            xact_count: 1_000,
            ..StatsSnapshot::default()
        };
        assert!(log.roll(t0, period, || totals), "a period begins at t0");
        totals.xact_count += 6_000;
        totals.query_count = 12_000;
        totals.xact_time_us = 3_000_000;
        totals.query_time_us = 1_200_000;
        totals.server_assignments = 600;
        totals.wait_time_us = 60_000;
        totals.bytes_received = 120_000;
        totals.bytes_sent = 600_000;
        totals.client_parses = 60;
        totals.binds = 120;
        let early = t0 + std::time::Duration::from_secs(30);
        assert!(!log.roll(early, period, || totals));
        assert!(log.roll(t0 + period, period, || totals));
        assert_eq!(
            log.last_line(),
            "stats: 100 xacts/s, 200 queries/s, 1 client parses/s, 0 server parses/s, \
             2 binds/s, in 2000 B/s, out 10000 B/s, xact 500 us, query 100 us, wait 100 us"
        );
        // The next period begins there: nothing happened since.
        assert!(log.roll(t0 + 2 * period, period, || totals));
        let idle = log.last_line();
        assert!(idle.starts_with("stats: 0 xacts/s, 0 queries/s"), "{idle}");
        assert!(idle.ends_with("xact 0 us, query 0 us, wait 0 us"), "{idle}");
    }

    #[test]
    fn averages_start_at_the_boundary_before_the_last() {
        let t0 = std::time::Instant::now();
        let periods = StatsPeriods::new(t0);
        let period = std::time::Duration::from_secs(60);
        let at = |n: u64| StatsSnapshot {
            xact_count: n,
            ..StatsSnapshot::default()
        };
        periods.roll(t0 + std::time::Duration::from_secs(30), period, || at(1));
        assert_eq!(periods.since().1.xact_count, 0, "not a period yet");
        periods.roll(t0 + period, period, || at(10));
        assert_eq!(periods.since().0, t0);
        periods.roll(t0 + 2 * period, period, || at(25));
        let (since, totals) = periods.since();
        assert_eq!((since, totals.xact_count), (t0 + period, 10));
    }

    #[test]
    fn pool_stats_sum_the_workers_stripes() {
        let stats = PoolStats::default();
        let mut local = LocalStats {
            xact_count: 2,
            bytes_sent: 100,
            autoprepared: 1,
            ..LocalStats::default()
        };
        stats.stripes[0].add(&mut local.clone());
        stats.stripes[2].add(&mut local);
        assert_eq!(
            local.xact_count, 0,
            "a session's counts are zeroed once added"
        );
        stats.stripes[1]
            .client_moves
            .fetch_add(3, Ordering::Relaxed);
        stats.stripes[1].pins[4].fetch_add(1, Ordering::Relaxed);
        stats.stripes[1].xact_duration.observe_us(300);
        stats.stripes[3].xact_duration.observe_us(20_000_000);
        let s = stats.snapshot();
        assert_eq!(
            (s.xact_count, s.bytes_sent, s.autoprepared, s.client_moves),
            (4, 200, 2, 3)
        );
        assert_eq!(s.pins, [0, 0, 0, 0, 1, 0]);
        let (counts, sum_us) = stats.xact_durations();
        assert_eq!((counts[1], counts[2], counts[14]), (0, 1, 2));
        assert_eq!(sum_us, 20_000_300);
        assert_eq!(std::mem::align_of::<PoolStripe>(), 128);
    }

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
            std::mem::align_of::<StripedCounter>(),
            128,
            "a stripe per cache-line pair"
        );
    }
}
