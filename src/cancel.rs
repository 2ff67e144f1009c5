//! Cancel requests that land where they were aimed.
//!
//! PostgreSQL cancels whatever its backend is running when the SIGINT arrives, and ignores one
//! that arrives while it waits for a command. Its postmaster signals twice (the backend, then
//! the backend's process group), so the second signal can reach the statement after the one
//! it cancelled, unless the next statement is sent only once the postmaster has closed the
//! cancel connection, as libpq's PQcancel waits for. Most drivers do not wait (tokio-postgres
//! returns once the request is written), and a pooler adds two ways of its own to miss: the
//! server may go back to the pool and on to another client, and the client's next statement
//! may be on its way to that server, before the request is passed on.
//!
//! So a client's [`Cancels`] say whether its work runs on its server, set and cleared by its
//! session, and count the requests being passed on to it. A request is passed on only while
//! the work runs ([`Cancels::begin`], one atomic step with the session's [`Cancels::done`]);
//! until it has been delivered the session writes nothing new to that server and keeps it out
//! of the pool ([`Cancels::pending`]), and is woken when the last one is. The session's cost:
//! one relaxed load per write to its server and per round of its relay loop, and a
//! read-modify-write when its work starts and when it ends.

use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

/// Whether a client's work runs on its server, and how many of its cancel requests are being
/// passed on (see the module documentation): one word, so that a request and the end of the
/// work it was aimed at are ordered.
#[derive(Debug, Default)]
pub struct Cancels(AtomicU8);

/// The client's work runs on its server: replies are owed.
const RUNNING: u8 = 1;
/// One request being passed on.
const ONE: u8 = 2;

impl Cancels {
    /// The session has sent the client's work to its server.
    #[inline]
    pub fn running(&self) {
        if self.0.load(Relaxed) & RUNNING == 0 {
            self.0.fetch_or(RUNNING, Relaxed);
        }
    }

    /// The client's work on its server is over: later requests do nothing. Returns whether
    /// requests aimed at it are still being passed on (see [`Cancels::pending`]).
    #[inline]
    pub fn done(&self) -> bool {
        let mut now = self.0.load(Relaxed);
        if now & RUNNING != 0 {
            now = self.0.fetch_and(!RUNNING, Relaxed);
        }
        now >= ONE
    }

    /// Requests are being passed on: the session sends nothing new to its server and does not
    /// give it back until they are delivered.
    #[inline]
    pub fn pending(&self) -> bool {
        self.0.load(Relaxed) >= ONE
    }

    /// A cancel request: counted in (true) if the client's work runs, to be passed on and then
    /// counted out with [`Cancels::end`]; otherwise it does nothing (false), as PostgreSQL
    /// ignores a cancel between statements. (Beyond 127 requests on their way for one client,
    /// one more would change nothing: it does nothing too.)
    pub fn begin(&self) -> bool {
        self.0
            .fetch_update(Relaxed, Relaxed, |now| {
                (now & RUNNING != 0).then(|| now.checked_add(ONE)).flatten()
            })
            .is_ok()
    }

    /// A request has been delivered (or given up). Returns whether it was the last one: the
    /// session is to be woken.
    pub fn end(&self) -> bool {
        self.0.fetch_sub(ONE, Relaxed) < 2 * ONE
    }
}

#[cfg(test)]
mod tests {
    use super::Cancels;

    #[test]
    fn a_request_is_passed_on_only_while_work_runs() {
        let c = Cancels::default();
        assert!(!c.begin(), "nothing runs");
        c.running();
        assert!(c.begin());
        assert!(c.pending());
        assert!(c.done(), "the work ended with the request still on its way");
        assert!(!c.begin(), "the work is over");
        assert!(c.end(), "the last one");
        assert!(!c.pending());
        assert!(!c.done());
    }

    #[test]
    fn requests_beyond_the_count_do_nothing() {
        let c = Cancels::default();
        c.running();
        let counted = std::iter::repeat_with(|| c.begin())
            .take(200)
            .filter(|&b| b)
            .count();
        assert_eq!(counted, 127);
        for _ in 1..counted {
            assert!(!c.end());
        }
        assert!(c.end());
        assert!(!c.pending());
        assert!(c.begin(), "still running");
    }

    #[test]
    fn several_requests_are_counted() {
        let c = Cancels::default();
        c.running();
        assert!(c.begin() && c.begin());
        assert!(!c.end());
        assert!(c.pending());
        assert!(c.end());
        assert!(!c.pending());
        assert!(!c.done(), "nothing was pending when the work ended");
    }
}
