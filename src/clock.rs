//! The monotonic clock of the hot path: a [`Moment`] is a reading of `CLOCK_MONOTONIC` (the
//! clock `std::time::Instant` reads on Linux) as nanoseconds in a `u64`, so that the intervals
//! each transaction measures (its time on a server, the server's lifetime and idle checks,
//! SHOW SERVERS' request time, SHOW CLIENTS' and SHOW QUERIES' times) are one subtraction.
//! `Instant`'s is a checked timespec subtraction in a call, ~37 instructions, made six times a
//! transaction (callgrind, issue 32). A `u64` of nanoseconds lasts 584 years of uptime.
//!
//! Most deadlines handed to timers ([`crate::timer`]) stay `Instant`s, off the hot path; the
//! wait for a server, which every transaction makes when clients outnumber servers, and the
//! server connect it may lead to keep theirs as `Moment`s ([`crate::timer::timeout_at_moment`]):
//! no clock reads to convert.

use std::time::Duration;

/// A point in time on the monotonic clock: nanoseconds since an arbitrary origin (the
/// machine's boot, for Linux), the same for every thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Moment(u64);

impl Moment {
    /// Reads the clock (vDSO: no system call).
    #[inline]
    pub fn now() -> Moment {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime only writes the timespec it is given, which lives here, and
        // CLOCK_MONOTONIC exists on every Linux (it cannot fail: `Instant::now` reads the
        // same clock and treats a failure as impossible too).
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        Moment(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
    }

    /// The time from `earlier` to this moment, or zero if `earlier` is later (as
    /// `Instant::saturating_duration_since`).
    #[inline]
    pub fn since(self, earlier: Moment) -> Duration {
        Duration::from_nanos(self.nanos_since(earlier))
    }

    /// [`Moment::since`] in whole microseconds.
    #[inline]
    pub fn micros_since(self, earlier: Moment) -> u64 {
        self.nanos_since(earlier) / 1_000
    }

    /// The moment `nanos` on the clock (see [`Moment::nanos`]).
    #[inline]
    pub fn from_nanos(nanos: u64) -> Moment {
        Moment(nanos)
    }

    /// The moment as nanoseconds on the clock (comparable between threads: see the type).
    #[inline]
    pub fn nanos(self) -> u64 {
        self.0
    }

    /// The time since this moment, read now.
    pub fn elapsed(self) -> Duration {
        Moment::now().since(self)
    }

    /// The moment `duration` after this one (saturating).
    #[inline]
    pub fn after(self, duration: Duration) -> Moment {
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        Moment(self.0.saturating_add(nanos))
    }

    /// The nanoseconds from `earlier` to this moment, or zero if `earlier` is later.
    #[inline]
    pub fn nanos_since(self, earlier: Moment) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_follow_instant_s_clock() {
        let (a, i) = (Moment::now(), std::time::Instant::now());
        std::thread::sleep(Duration::from_millis(20));
        let (b, j) = (Moment::now(), std::time::Instant::now());
        assert!(b > a);
        let (ours, std) = (b.since(a), j.duration_since(i));
        let diff = ours.abs_diff(std);
        assert!(diff < Duration::from_millis(5), "{ours:?} vs {std:?}");
        assert_eq!(a.since(b), Duration::ZERO);
        assert_eq!(b.micros_since(a), b.since(a).as_micros() as u64);
        assert!(a.elapsed() >= ours);
    }

    #[test]
    fn a_moment_after_a_duration_comes_that_much_later() {
        let now = Moment::now();
        let minute = Duration::from_secs(60);
        assert_eq!(now.after(minute).since(now), minute);
        assert_eq!(now.after(Duration::MAX), Moment::from_nanos(u64::MAX));
        // On the clock: passed once the duration has.
        let soon = Moment::now().after(Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(20));
        assert!(Moment::now() >= soon);
    }
}
