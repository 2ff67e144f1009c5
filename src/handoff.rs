//! Where an online restart meets the sessions (see [`crate::takeover`]): the old process's
//! idle sessions leave through an [`Outbox`] as [`Handoff`]s (their client's socket and what
//! the new process needs to go on serving it), and the new process passes cancel requests
//! for clients still served by the old one back to it ([`Outbox::forward_cancel`]).
//!
//! A floor below the session and the takeover: the session puts its client in the outbox
//! without knowing where it goes, and the takeover empties it without knowing sessions.

use parking_lot::Mutex;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;

/// A client leaving this process: its socket and its session's state, encoded by the session
/// (`session::handover`) and read by the new process's.
pub struct Handoff {
    pub state: Vec<u8>,
    pub socket: OwnedFd,
}

/// Passes a CancelRequest whose key this process does not know to the process that may
/// (the old one, during an online restart).
pub type CancelForwarder = Box<dyn Fn(i32, i32) + Send + Sync>;

/// The App's part of an online restart.
#[derive(Default)]
pub struct Outbox {
    /// A new process takes this one's clients over: idle sessions leave through `sink`.
    open: AtomicBool,
    sink: Mutex<Option<Sender<Handoff>>>,
    /// Handed over but not written to the new process yet: the process waits for them
    /// before it exits.
    in_flight: AtomicUsize,
    /// Clients written to the new process, and whether a takeover ever began.
    handed: AtomicUsize,
    began: AtomicBool,
    /// This process took over from one still running: unknown cancel keys go to it.
    predecessor: Mutex<Option<CancelForwarder>>,
}

impl Outbox {
    /// From now on idle sessions hand their clients to `sink`.
    pub fn open(&self, sink: Sender<Handoff>) {
        *self.sink.lock() = Some(sink);
        self.began.store(true, Ordering::SeqCst);
        self.open.store(true, Ordering::SeqCst);
    }

    /// Whether a new process is taking this one's clients over.
    #[inline]
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    /// Hands a client over; gives it back when the new process is gone.
    pub fn send(&self, handoff: Handoff) -> Result<(), Handoff> {
        match self.sink.lock().as_ref() {
            Some(sink) => {
                self.in_flight.fetch_add(1, Ordering::SeqCst);
                sink.send(handoff).map_err(|e| {
                    self.in_flight.fetch_sub(1, Ordering::SeqCst);
                    e.0
                })
            }
            None => Err(handoff),
        }
    }

    /// One handoff was written to the new process (`delivered`), or lost with it.
    pub fn sent(&self, delivered: bool) {
        if delivered {
            self.handed.fetch_add(1, Ordering::SeqCst);
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    /// How many clients went to a new process; None when no takeover began.
    pub fn handed(&self) -> Option<usize> {
        self.began
            .load(Ordering::SeqCst)
            .then(|| self.handed.load(Ordering::SeqCst))
    }

    /// Clients handed over and not yet written to the new process.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// The new process went away: sessions stay here (and end with the shutdown).
    pub fn close(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.sink.lock().take();
    }

    /// Sets where unknown cancel keys go (None: nowhere, the old process has exited).
    pub fn set_predecessor(&self, forward: Option<CancelForwarder>) {
        *self.predecessor.lock() = forward;
    }

    /// Passes a cancel request with an unknown key on to the old process, if one still runs.
    pub fn forward_cancel(&self, pid: i32, secret: i32) {
        if let Some(forward) = self.predecessor.lock().as_ref() {
            forward(pid, secret);
        }
    }
}
