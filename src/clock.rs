//! The monotonic clock of the hot path: a [`Moment`] is a reading of `CLOCK_MONOTONIC` (the
//! clock `std::time::Instant` reads on Linux) as nanoseconds in a `u64`, so that the intervals
//! each transaction measures (its time on a server, the server's lifetime and idle checks,
//! SHOW SERVERS' request time, SHOW CLIENTS' and SHOW QUERIES' times) are one subtraction.
//! `Instant`'s is a checked timespec subtraction in a call, ~37 instructions, made six times a
//! transaction (callgrind, issue 32). A `u64` of nanoseconds lasts 584 years of uptime.
//!
//! Deadlines handed to timers ([`crate::timer`]) stay `Instant`s: they are off the hot path.

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

    #[inline]
    fn nanos_since(self, earlier: Moment) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

/// A tick every `period` for a task of an event loop, from a Linux timerfd the loop watches
/// as it watches a socket: a timer its timer wheel does not hold. While the wheel holds a
/// timer, tokio's time driver reads the clock an extra time and scans the wheel at every
/// park; the janitor's 1 s interval was the only timer in a steady pool's loop, and cost
/// ~400 instructions a `pgbench -S -M simple` transaction at one client (`bench/budget.py`),
/// as the WAL follower's status deadline did a cache hit. A thread that sleeps and sends
/// would do it too, but a second thread makes glibc's `send` and `recv` mark themselves
/// cancellation points at every call, which cost more (+140 a transaction at 8 clients,
/// measured). Without a timerfd (or once its registration fails), the loop's timers tick
/// ([`crate::timer::interval`]). (Every timer of a loop is on one timerfd now, see
/// [`crate::timer`]; a ticker keeps its own, read without the wheel's map.)
pub struct Ticker {
    period: Duration,
    fd: Option<tokio::io::unix::AsyncFd<timerfd::TimerFd>>,
    /// The loop's, made when the timerfd is not there.
    interval: Option<crate::timer::Interval>,
}

impl Ticker {
    /// Ticks at once, then every `period` (as `crate::timer::interval`). On the current tokio
    /// runtime.
    pub fn every(period: Duration) -> Ticker {
        let fd = Ticker::timerfd(period)
            .inspect_err(|e| tracing::warn!(error = %e, "no timerfd: the loop's timers tick"))
            .ok();
        Ticker {
            period,
            fd,
            interval: None,
        }
    }

    fn timerfd(period: Duration) -> std::io::Result<tokio::io::unix::AsyncFd<timerfd::TimerFd>> {
        let mut fd = timerfd::TimerFd::new_custom(timerfd::ClockId::Monotonic, true, true)?;
        fd.set_state(
            timerfd::TimerState::Periodic {
                // (Zero would disarm it.)
                current: Duration::from_nanos(1),
                interval: period,
            },
            timerfd::SetTimeFlags::Default,
        );
        let interest = tokio::io::Interest::READABLE;
        // SAFETY: the TimerFd owns its file descriptor (an OwnedFd), open until it is dropped
        // with the AsyncFd that owns it, and gives the same one at every call.
        unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, interest) }
            .map_err(std::io::Error::from)
    }

    /// Waits for the next tick (at once if one came since the last call; ticks missed
    /// meanwhile are one).
    pub async fn tick(&mut self) {
        if let Some(fd) = self.fd.as_ref() {
            loop {
                let Ok(mut ready) = fd.readable().await else {
                    break; // the I/O driver is gone: the loop's timers from now on
                };
                if ready.get_inner().read() > 0 {
                    return;
                }
                ready.clear_ready();
            }
            self.fd = None;
        }
        let period = self.period;
        let interval = self
            .interval
            .get_or_insert_with(|| crate::timer::interval(period));
        interval.tick().await;
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
    fn a_ticker_ticks_every_period() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("a runtime without timers");
        runtime.block_on(async {
            let started = Moment::now();
            let mut ticker = Ticker::every(Duration::from_millis(10));
            assert!(ticker.fd.is_some(), "a timerfd");
            // The first tick at once, as tokio's interval's.
            for n in 0..=3 {
                ticker.tick().await;
                assert!(
                    started.elapsed() >= Duration::from_millis(10 * n),
                    "tick {n}"
                );
            }
            assert!(ticker.interval.is_none(), "no other timer");
        });
    }
}
