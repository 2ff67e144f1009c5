//! The timers of pgmemo's event loops: sleeps, timeouts and intervals on one Linux timerfd per
//! loop, so that the loops run without tokio's time driver.
//!
//! Why: with the time driver on, every park of a loop reads the clock and scans the timer
//! wheel, timers or not: ~300 instructions a park (callgrind, `bench/budget.py`), two parks a
//! `pgbench -S` transaction at one client. Here a loop's timers are kept in a map by deadline
//! and the timerfd is set to the earliest: the loop hears of them as it hears of a socket, only
//! when one is due, and a park costs nothing for them.
//!
//! [`install`] gives the calling thread its wheel when it runs a single-threaded runtime (each
//! of pgmemo's loops, and the tests' default runtime); a timer polled on a thread without one
//! (a multi-threaded runtime) is tokio's. A session that moves to another loop takes its timers
//! along: one polled on another loop than its own is set there, and the first loop's copy
//! wakes the task once for nothing.
//!
//! The API is tokio's (`sleep`, `sleep_until`, `timeout`, `timeout_at`, `interval`), with
//! `std::time::Instant` deadlines; an interval's missed ticks are delayed
//! (`MissedTickBehavior::Delay`), the only behaviour pgmemo uses.

use crate::clock::Moment;
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

thread_local! {
    static WHEEL: RefCell<Option<Wheel>> = const { RefCell::new(None) };
}

/// Wheels are told apart by a number no other wheel of the process has (below 2^32: a
/// timer's key holds it beside its slot).
static WHEELS: AtomicU64 = AtomicU64::new(1);

/// One loop's timers.
struct Wheel {
    id: u64,
    fd: Arc<OwnedFd>,
    /// Its task runs (false once its runtime dropped it: a later runtime on the thread
    /// gets a wheel of its own).
    alive: Arc<AtomicBool>,
    timers: Timers,
    /// The deadline the timerfd is set to (`u64::MAX`: none).
    armed: u64,
}

/// A loop's timers by deadline ([`Moment`] nanoseconds): each a slot holding its task's waker,
/// and a min-heap of (deadline, slot, timer number). A timer cancelled leaves its heap entry
/// behind (its slot emptied or holding a later timer), skipped when it comes up, and all such
/// are dropped at once when they outnumber the live ones: a set and a cancel are a push and a
/// mark, ~50 instructions, where a B-tree's insert and remove took ~250 each (callgrind: a
/// client waiting for a server sets and cancels two, at every transaction when clients
/// outnumber servers). Deadlines mostly come in rising order (now plus a fixed timeout), which
/// a push sifts at once. A timer's number is never given twice by its wheel, so a key kept
/// past its timer's end never names another.
#[derive(Default)]
struct Timers {
    slots: Vec<Slot>,
    free: Vec<u32>,
    heap: BinaryHeap<Reverse<(u64, u32, u64)>>,
    live: usize,
    next: u64,
}

#[derive(Default)]
struct Slot {
    number: u64,
    waker: Option<Waker>,
}

impl Slot {
    fn holds(&self, number: u64) -> bool {
        self.number == number && self.waker.is_some()
    }
}

impl Timers {
    /// A new timer waking `waker` at `deadline`: its slot and number.
    fn insert(&mut self, deadline: u64, waker: Waker) -> (u32, u64) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot::default());
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 timers")
            }
        };
        let number = self.next;
        self.next += 1;
        self.slots[slot as usize] = Slot {
            number,
            waker: Some(waker),
        };
        self.heap.push(Reverse((deadline, slot, number)));
        self.live += 1;
        (slot, number)
    }

    /// `slot`, if it still holds the timer `number` (live, or ended and not reused).
    fn slot_of(&mut self, slot: u32, number: u64) -> Option<&mut Slot> {
        self.slots
            .get_mut(slot as usize)
            .filter(|s| s.number == number)
    }

    /// The waker of the live timer `number` in `slot`.
    fn get_mut(&mut self, slot: u32, number: u64) -> Option<&mut Waker> {
        self.slot_of(slot, number)?.waker.as_mut()
    }

    /// Cancels the timer `number` in `slot`, if live: its waker.
    fn remove(&mut self, slot: u32, number: u64) -> Option<Waker> {
        let waker = self.take(slot, number)?;
        // The heap's entries of cancelled timers, once more than the live ones (and a few):
        // dropped at once, so the heap stays within about twice the timers set.
        if self.heap.len() > 2 * self.live + 64 {
            let slots = &self.slots;
            self.heap
                .retain(|Reverse((_, s, n))| slots[*s as usize].holds(*n));
        }
        Some(waker)
    }

    fn take(&mut self, slot: u32, number: u64) -> Option<Waker> {
        let waker = self.slot_of(slot, number)?.waker.take()?;
        self.free.push(slot);
        self.live -= 1;
        Some(waker)
    }

    /// Takes the wakers of the timers due at `now`.
    fn due(&mut self, now: u64) -> Vec<Waker> {
        let mut due = Vec::new();
        while let Some(&Reverse((deadline, slot, number))) = self.heap.peek() {
            if deadline > now {
                break;
            }
            self.heap.pop();
            due.extend(self.take(slot, number));
        }
        due
    }

    /// The earliest deadline of a live timer (the cancelled ones before it dropped).
    fn next_deadline(&mut self) -> Option<u64> {
        while let Some(&Reverse((deadline, slot, number))) = self.heap.peek() {
            if self.slots[slot as usize].holds(number) {
                return Some(deadline);
            }
            self.heap.pop();
        }
        None
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.live == 0
    }
}

/// A timer's key as a [`Sleep`] keeps it: its wheel's id with its slot, and its number.
fn timer_key(wheel: u64, (slot, number): (u32, u64)) -> (u64, u64) {
    ((wheel << 32) | u64::from(slot), number)
}

/// The slot of a key on wheel `wheel`, None when it is another wheel's.
fn slot_on(wheel: u64, (wheel_slot, _): (u64, u64)) -> Option<u32> {
    (wheel_slot >> 32 == wheel).then_some(wheel_slot as u32)
}

impl Wheel {
    fn alive(&self) -> bool {
        self.alive.load(Relaxed)
    }

    /// Sets the timer `key` (made if None, or set on another wheel) to wake `waker` at
    /// `deadline`.
    fn set(&mut self, key: &mut Option<(u64, u64)>, deadline: u64, waker: &Waker) {
        if let Some(w) = key.and_then(|k| self.timers.get_mut(slot_on(self.id, k)?, k.1)) {
            if !w.will_wake(waker) {
                w.clone_from(waker);
            }
            return;
        }
        let timer = self.timers.insert(deadline, waker.clone());
        *key = Some(timer_key(self.id, timer));
        if deadline < self.armed {
            self.arm(deadline);
        }
    }

    /// Cancels the timer `key` if it is this wheel's and live: its waker.
    fn remove(&mut self, key: (u64, u64)) -> Option<Waker> {
        self.timers.remove(slot_on(self.id, key)?, key.1)
    }

    fn arm(&mut self, deadline: u64) {
        self.armed = deadline;
        let at = libc::timespec {
            tv_sec: (deadline / 1_000_000_000) as libc::time_t,
            tv_nsec: (deadline % 1_000_000_000) as libc::c_long,
        };
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: at,
        };
        // SAFETY: the fd is a timerfd this wheel owns (with its task), and the specs live
        // here. A deadline of 0 would disarm it: Moment's clock is past 0 at once.
        let set = unsafe {
            libc::timerfd_settime(
                self.fd.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if set != 0 {
            tracing::error!(error = %std::io::Error::last_os_error(), "timerfd_settime failed");
        }
    }

    /// Takes the wakers of the timers due at `now` and sets the timerfd to the next one.
    fn due(&mut self, now: u64) -> Vec<Waker> {
        let due = self.timers.due(now);
        self.armed = u64::MAX;
        if let Some(next) = self.timers.next_deadline() {
            self.arm(next);
        }
        due
    }
}

/// Gives the calling thread its wheel, driven by a task on the current runtime, if that is a
/// single-threaded one (whose tasks all run on this thread) and the thread has none yet.
/// True when the thread has a wheel.
pub fn install() -> bool {
    let handle = tokio::runtime::Handle::current();
    if handle.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread {
        return false;
    }
    if WHEEL.with(|w| w.borrow().as_ref().is_some_and(Wheel::alive)) {
        return true;
    }
    // SAFETY: plain system call; the fd it returns is owned below.
    let raw = unsafe {
        libc::timerfd_create(
            libc::CLOCK_MONOTONIC,
            libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
        )
    };
    if raw < 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "no timerfd: tokio's timers");
        return false;
    }
    // SAFETY: a new fd, owned by nothing else.
    let fd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
    // SAFETY: the Arc keeps the fd open while the AsyncFd (which holds one) lives, and it
    // gives the same fd at every call.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd.clone(), tokio::io::Interest::READABLE)
    };
    let Ok(watched) = registered else {
        return false;
    };
    let id = WHEELS.fetch_add(1, Relaxed);
    let alive = Arc::new(AtomicBool::new(true));
    WHEEL.with(|w| {
        *w.borrow_mut() = Some(Wheel {
            id,
            fd,
            alive: alive.clone(),
            timers: Timers::default(),
            armed: u64::MAX,
        })
    });
    handle.spawn(drive(watched, Alive(alive)));
    true
}

/// Marks its wheel dead when the wheel's task is dropped (with its runtime).
struct Alive(Arc<AtomicBool>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, Relaxed);
    }
}

/// The wheel's task: wakes the tasks whose timers are due each time the timerfd fires.
async fn drive(fd: tokio::io::unix::AsyncFd<Arc<OwnedFd>>, _alive: Alive) {
    loop {
        let Ok(mut ready) = fd.readable().await else {
            return; // the runtime is going away
        };
        let mut expirations = [0u8; 8];
        // SAFETY: reads at most 8 bytes into the array, from the timerfd.
        let _ = unsafe {
            libc::read(
                fd.get_ref().as_raw_fd(),
                expirations.as_mut_ptr().cast(),
                expirations.len(),
            )
        };
        // Before the timerfd is set again: a deadline already past fires it anew.
        ready.clear_ready();
        let now = Moment::now().nanos();
        let due = WHEEL.with(|w| w.borrow_mut().as_mut().map(|w| w.due(now)));
        // Woken outside the borrow: a wake may drop a task, and its timers with it.
        for waker in due.into_iter().flatten() {
            waker.wake();
        }
    }
}

/// Moment nanoseconds of `deadline`.
fn nanos_of(deadline: Instant) -> u64 {
    let after = deadline.saturating_duration_since(Instant::now());
    Moment::now()
        .nanos()
        .saturating_add(u64::try_from(after.as_nanos()).unwrap_or(u64::MAX))
}

/// A future done at its deadline ([`sleep`], [`sleep_until`]).
#[derive(Debug)]
pub struct Sleep {
    deadline: u64,
    /// (wheel, timer number), once set on a wheel.
    key: Option<(u64, u64)>,
    /// tokio's, on a thread without a wheel.
    fallback: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// Done after `duration`.
pub fn sleep(duration: Duration) -> Sleep {
    let after = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
    Sleep::at(Moment::now().nanos().saturating_add(after))
}

/// Done at `deadline`.
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep::at(nanos_of(deadline))
}

impl Sleep {
    fn at(deadline: u64) -> Sleep {
        Sleep {
            deadline,
            key: None,
            fallback: None,
        }
    }

    /// Done at `deadline` instead (as tokio's `Sleep::reset`).
    pub fn reset(self: Pin<&mut Self>, deadline: Instant) {
        let this = self.get_mut();
        if let Some(tokio_sleep) = this.fallback.as_mut() {
            tokio_sleep.as_mut().reset(deadline.into());
            return;
        }
        this.deadline = nanos_of(deadline);
        // Set on this loop's wheel: moved there with its waker, as tokio's is (the task
        // need not poll it again to be woken at the new deadline).
        let Some(key) = this.key.take() else {
            return;
        };
        WHEEL.with(|w| {
            let mut w = w.borrow_mut();
            let Some(w) = w.as_mut() else {
                return;
            };
            if let Some(waker) = w.remove(key) {
                w.set(&mut this.key, this.deadline, &waker);
            }
        });
    }

    fn cancel(&mut self) {
        let Some(key) = self.key.take() else {
            return;
        };
        // (At a thread's exit the wheel may be gone; during its task's wake-ups, borrowed.)
        let _ = WHEEL.try_with(|w| {
            if let Ok(mut w) = w.try_borrow_mut() {
                if let Some(w) = w.as_mut() {
                    w.remove(key);
                }
            }
        });
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        if let Some(tokio_sleep) = this.fallback.as_mut() {
            return tokio_sleep.as_mut().poll(cx);
        }
        if Moment::now().nanos() >= this.deadline {
            this.cancel();
            return Poll::Ready(());
        }
        let set = WHEEL.with(|w| match w.borrow_mut().as_mut().filter(|w| w.alive()) {
            Some(wheel) => {
                wheel.set(&mut this.key, this.deadline, cx.waker());
                true
            }
            None => false,
        });
        if set {
            return Poll::Pending;
        }
        let left = this.deadline.saturating_sub(Moment::now().nanos());
        let deadline = tokio::time::Instant::now() + Duration::from_nanos(left);
        this.fallback
            .insert(Box::pin(tokio::time::sleep_until(deadline)))
            .as_mut()
            .poll(cx)
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// A [`timeout`] passed before its future was done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

impl std::fmt::Display for Elapsed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("deadline has elapsed") // tokio's words
    }
}

impl std::error::Error for Elapsed {}

impl From<Elapsed> for std::io::Error {
    fn from(_: Elapsed) -> std::io::Error {
        std::io::ErrorKind::TimedOut.into()
    }
}

/// `future`'s output, unless `duration` (from now) passes first.
pub fn timeout<F: Future>(duration: Duration, future: F) -> Timeout<F> {
    Timeout {
        future,
        limit: sleep(duration),
    }
}

/// `future`'s output, unless `deadline` passes first.
pub fn timeout_at<F: Future>(deadline: Instant, future: F) -> Timeout<F> {
    Timeout {
        future,
        limit: sleep_until(deadline),
    }
}

/// [`timeout_at`] with the deadline as a [`Moment`] (no clock read to convert it).
pub fn timeout_at_moment<F: Future>(deadline: Moment, future: F) -> Timeout<F> {
    Timeout {
        future,
        limit: Sleep::at(deadline.nanos()),
    }
}

pin_project_lite::pin_project! {
    /// [`timeout`]'s future: the future and its limit side by side, nothing more (an `async`
    /// block would keep the future twice, its argument and its pinned copy: every idle
    /// client's task grew by its login's size, ~300 bytes, `bench/run.py --idle-clients`).
    #[derive(Debug)]
    pub struct Timeout<F> {
        #[pin]
        future: F,
        limit: Sleep,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        // The future first, as tokio's timeout: one done at its deadline is done.
        if let Poll::Ready(output) = this.future.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        Pin::new(this.limit).poll(cx).map(|()| Err(Elapsed))
    }
}

/// Ticks at once, then every `period` ([`Interval::tick`]).
pub fn interval(period: Duration) -> Interval {
    Interval {
        period: u64::try_from(period.as_nanos()).unwrap_or(u64::MAX).max(1),
        next: Moment::now().nanos(),
    }
}

/// [`interval`]'s ticks.
#[derive(Debug)]
pub struct Interval {
    period: u64,
    /// The next tick's deadline.
    next: u64,
}

impl Interval {
    /// Waits for the next tick. A tick missed by a period or more is delayed: the next comes
    /// a period after it was seen. Cancel-safe: a wait dropped leaves the tick to come.
    pub async fn tick(&mut self) {
        Sleep::at(self.next).await;
        let now = Moment::now().nanos();
        self.next = if now >= self.next.saturating_add(self.period) {
            now.saturating_add(self.period)
        } else {
            self.next.saturating_add(self.period)
        };
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
/// ([`interval`]). (Every timer of a loop is on one timerfd now; a ticker keeps its own, read
/// without the wheel's map.)
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
        let interval = self.interval.get_or_insert_with(|| interval(period));
        interval.tick().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(5);

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("a runtime without tokio's timers")
    }

    /// On a loop without tokio's time driver: sleeps end at their deadline, in order, a
    /// timeout passes or not, a dropped sleep wakes nobody, an interval ticks at once then
    /// every period.
    #[test]
    fn timers_without_tokio_s_time_driver() {
        runtime().block_on(async {
            assert!(install());
            let started = Instant::now();
            // Set in the wrong order: the timerfd follows the earliest.
            let late = tokio::spawn(async move {
                sleep(Duration::from_millis(60)).await;
                started.elapsed()
            });
            let early = tokio::spawn(async move {
                sleep_until(started + Duration::from_millis(20)).await;
                started.elapsed()
            });
            let (early, late) = (early.await.unwrap(), late.await.unwrap());
            assert!(early >= Duration::from_millis(20), "{early:?}");
            assert!(late >= Duration::from_millis(60), "{late:?}");
            assert!(early < late);

            let never = std::future::pending::<()>();
            assert_eq!(
                timeout(Duration::from_millis(10), never).await,
                Err(Elapsed)
            );
            assert_eq!(timeout(Duration::from_secs(10), async { 7 }).await, Ok(7));

            // Dropped before it is due: its timer goes with it.
            let dropped = tokio::spawn(sleep(Duration::from_millis(5)));
            tokio::task::yield_now().await; // it runs once: its timer is set
            assert!(WHEEL.with(|w| !w.borrow().as_ref().unwrap().timers.is_empty()));
            dropped.abort();
            let _ = dropped.await;
            assert!(WHEEL.with(|w| w.borrow().as_ref().unwrap().timers.is_empty()));

            let ticks = Instant::now();
            let mut every = interval(Duration::from_millis(10));
            every.tick().await;
            assert!(
                ticks.elapsed() < Duration::from_millis(10),
                "the first at once"
            );
            every.tick().await;
            every.tick().await;
            assert!(ticks.elapsed() >= Duration::from_millis(20));
        });
    }

    /// The timers' slots and heap against a map by (deadline, number): every set, cancel and
    /// due in a long pseudo-random run (rising deadlines and scattered ones, cancels of live
    /// and of ended timers, keys kept past their timer's end) gives the same wakers, and the
    /// heap stays within about twice the live timers.
    #[test]
    fn the_timers_are_a_map_by_deadline() {
        use std::collections::BTreeMap;
        use std::sync::atomic::AtomicUsize;
        use std::task::Wake;
        struct Count(usize, Arc<AtomicUsize>);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.1.fetch_add(self.0 + 1, Relaxed);
            }
        }
        let woken = Arc::new(AtomicUsize::new(0));
        let mut timers = Timers::default();
        let mut model: BTreeMap<(u64, u64), usize> = BTreeMap::new();
        let mut keys: Vec<((u32, u64), u64)> = Vec::new(); // (key, deadline), ended ones too
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut random = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut now = 0;
        for step in 0..20_000usize {
            match random(10) {
                0..=4 => {
                    let deadline = if random(2) == 0 {
                        now + 1_000 + random(10) // rising, as a wait's timeout
                    } else {
                        now + random(2_000)
                    };
                    let waker = Waker::from(Arc::new(Count(step, woken.clone())));
                    let key = timers.insert(deadline, waker);
                    model.insert((deadline, key.1), step);
                    keys.push((key, deadline));
                }
                5..=7 if !keys.is_empty() => {
                    let (key, deadline) = keys.swap_remove(random(keys.len() as u64) as usize);
                    let was = model.remove(&(deadline, key.1));
                    assert_eq!(timers.remove(key.0, key.1).is_some(), was.is_some());
                    assert!(timers.get_mut(key.0, key.1).is_none());
                }
                _ => {
                    now += random(300);
                    let later = model.split_off(&(now + 1, 0));
                    let due = std::mem::replace(&mut model, later);
                    woken.store(0, Relaxed);
                    let wakers = timers.due(now);
                    assert_eq!(wakers.len(), due.len());
                    wakers.into_iter().for_each(Waker::wake);
                    assert_eq!(
                        woken.load(Relaxed),
                        due.values().map(|s| s + 1).sum::<usize>()
                    );
                    assert_eq!(
                        timers.next_deadline(),
                        model.keys().next().map(|k| k.0),
                        "the next deadline, step {step}"
                    );
                }
            }
            assert_eq!(timers.live, model.len());
            assert_eq!(timers.is_empty(), model.is_empty());
            assert!(
                timers.heap.len() <= 2 * timers.live + 64 + 1_000,
                "step {step}"
            );
        }
    }

    /// A timeout holds its future once, beside its limit (a login's future is ~1 KiB, and
    /// 2,000 clients logging in at once each hold one).
    #[test]
    fn a_timeout_keeps_its_future_once() {
        fn size<T>(_: &T) -> usize {
            std::mem::size_of::<T>()
        }
        let future = async {
            let block = [1u8; 1000];
            std::future::ready(()).await;
            block[999]
        };
        let alone = size(&future);
        let limited = timeout(Duration::from_secs(1), future);
        assert!(
            size(&limited) <= alone + std::mem::size_of::<Sleep>() + 8,
            "{} for a future of {alone}",
            size(&limited)
        );
    }

    /// A runtime after another on the same thread gets a wheel of its own: the first one's
    /// task went with its runtime.
    #[test]
    fn a_later_runtime_gets_a_wheel_of_its_own() {
        for _ in 0..2 {
            // (tokio's timers too, to fail rather than hang if the sleep never ends.)
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                assert!(install());
                let started = Instant::now();
                // (tokio's timeout polls the sleep at its own deadline, which ends it then.)
                let _ = tokio::time::timeout(Duration::from_secs(2), sleep(MS)).await;
                let slept = started.elapsed();
                assert!(slept >= MS && slept < Duration::from_secs(1), "{slept:?}");
            });
        }
    }

    /// A thread without a wheel (a multi-threaded runtime's) uses tokio's timer.
    #[test]
    fn tokio_s_timer_where_there_is_no_wheel() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            assert!(!install());
            let started = Instant::now();
            sleep(Duration::from_millis(15)).await;
            assert!(started.elapsed() >= Duration::from_millis(15));
        });
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
