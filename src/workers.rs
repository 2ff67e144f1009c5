//! Worker threads, each with an event loop of its own (`general.workers`).
//!
//! By default pgmemo runs on one thread, like PgBouncer: forwarding a transaction costs a few
//! microseconds, and a multi-threaded scheduler's cross-thread wake-ups cost more than a
//! second core gains on a small machine shared with PostgreSQL. A cache hit is different: it
//! is answered inside pgmemo, so one thread bounds how many hits pgmemo serves. With
//! `workers = N` there are N single-threaded event loops (the one pgmemo starts on and N-1
//! more), and an accepted client goes to the one of the CPU its packets arrive on
//! ([`Workers::serve`]); between transactions a session moves to the worker of the CPU its
//! client sends from now, when that changed (`Session::worker_to_move_to`). Nothing is stolen
//! between them: a client's socket, its session and
//! (after [`crate::server::ServerConn::move_here`]) the server it holds are all served by its
//! own worker, and a server checked in goes to a queued client of the same worker first
//! (`pool::PoolState::next_waiter`), so a transaction rarely wakes another thread. What the
//! workers share (pools, statement registry, result cache, statistics) was already safe to
//! share: locks held for a few instructions, or lock-free; the counters every transaction or
//! hit writes have a part per worker (`stats::PoolStats`, [`StripedCounter`]).

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::stream::Stream;
use tokio::runtime::Handle;
use tokio::sync::watch;

thread_local! {
    /// The worker this thread runs: 0 for the thread pgmemo started on (and for any thread
    /// that is not a worker), 1..N for the others.
    static CURRENT: Cell<u16> = const { Cell::new(0) };
}

/// The worker whose event loop runs on this thread.
#[inline]
pub fn current() -> u16 {
    CURRENT.with(|c| c.get())
}

/// The workers' event loops, as the sessions reach them (`App::workers`): a session moves to
/// the worker of the CPU its client now sends from, between transactions
/// (`Session::worker_to_move_to`).
#[derive(Clone)]
pub struct Loops(Arc<[Handle]>);

impl Loops {
    /// How many event loops serve clients.
    #[inline]
    pub fn count(&self) -> usize {
        self.0.len()
    }

    /// The worker a connection belongs on: the one the CPU that last received its packets
    /// maps to (over loopback, the CPU its client's thread last sent from), if that is known.
    pub fn worker_of(&self, tcp: &tokio::net::TcpStream) -> Option<u16> {
        incoming_cpu(tcp).map(|cpu| (cpu % self.count()) as u16)
    }

    /// Runs `task` on worker `id`'s event loop.
    pub fn spawn<F>(&self, id: u16, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        drop(self.0[id as usize].spawn(task));
    }
}

/// The extra workers' threads; dropping it stops them (their clients are gone by then:
/// [`crate::Pgmemo::wait`] drops it last).
pub struct Workers {
    loops: Loops,
    /// The next worker a client goes to when its CPU is not known.
    next: AtomicUsize,
    _stop: watch::Sender<()>,
}

/// An event loop's runtime (the thread pgmemo starts on, and each worker's): single-threaded,
/// like PgBouncer (a proxy's work per transaction is a few microseconds, and on a small machine
/// shared with PostgreSQL a multi-threaded scheduler's cross-thread wake-ups cost more than a
/// second core gains: measured 9.5 vs 11.8 µs of pgmemo CPU per `pgbench -S -M prepared`
/// transaction on 2 cores). Its I/O driver only, its timers being its own
/// ([`crate::timer::install`]); with `tokio_timers` tokio's time driver too (see
/// `Config::needs_tokio_timers`).
pub fn event_loop(tokio_timers: bool) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_io();
    if tokio_timers {
        builder.enable_time();
    }
    builder.build()
}

impl Workers {
    /// Starts `count - 1` threads, each running a single-threaded event loop until the
    /// returned value is dropped. The caller's own thread (inside a tokio runtime) is worker 0.
    /// Each loop has its timers' wheel ([`crate::timer::install`]).
    /// `tokio_timers`: with tokio's time driver too (see [`crate::timer`]: the shared tier's
    /// Valkey client needs it).
    pub fn start(count: usize, tokio_timers: bool) -> std::io::Result<Workers> {
        let (stop, stopped) = watch::channel(());
        let mut handles = Vec::with_capacity(count.max(1));
        handles.push(Handle::try_current().map_err(std::io::Error::other)?);
        for id in 1..count {
            let runtime = event_loop(tokio_timers)?;
            handles.push(runtime.handle().clone());
            let mut stopped = stopped.clone();
            std::thread::Builder::new()
                .name(format!("pgmemo-worker-{id}"))
                .spawn(move || {
                    CURRENT.with(|c| c.set(id as u16));
                    // Runs its clients' tasks until the sender is dropped.
                    runtime.block_on(async move {
                        crate::timer::install();
                        let _ = stopped.changed().await;
                    });
                })?;
        }
        Ok(Workers {
            loops: Loops(handles.into()),
            next: AtomicUsize::new(0),
            _stop: stop,
        })
    }

    /// How many event loops serve clients, the caller's included.
    pub fn count(&self) -> usize {
        self.loops.count()
    }

    /// The event loops, for the sessions to move between.
    pub fn loops(&self) -> Loops {
        self.loops.clone()
    }

    /// Serves an accepted client on a worker: the one the CPU that received its packets
    /// maps to, else the next in turn. By the CPU, the connections of one client thread
    /// (which ran on one CPU when it connected) share a worker, and the scheduler can keep
    /// the pair on one core: dealt in turn instead, each client thread talks to every worker
    /// and the wake-ups cross cores (measured: 105-125k instead of 170-205k cache hits per
    /// second, pgbench -c 8 -j 2 against 2 workers on 2 cores). A client on the Unix socket
    /// (`unix_socket_dir`) has no incoming CPU and is dealt in turn.
    ///
    /// `handle` serves the connection (`connection::serve_client`, given by the caller:
    /// the workers are a floor below the rooms that serve clients).
    pub fn serve<H, F>(&self, client: Stream, handle: H)
    where
        H: FnOnce(Stream) -> F + Send + 'static,
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let turn = match self.count() {
            1 => 0,
            count => match client.tcp().and_then(|tcp| self.loops.worker_of(tcp)) {
                Some(worker) => worker,
                None => (self.next.fetch_add(1, Ordering::Relaxed) % count) as u16,
            },
        };
        if turn == current() {
            // Boxed: tokio aligns a task to 128 bytes, rounding a future of a few hundred
            // bytes up by as much again; in a box it is allocated at its own size.
            tokio::spawn(Box::pin(handle(client)));
            return;
        }
        // The socket leaves this thread's event loop and joins the worker's.
        let std = match Unregistered::take(client) {
            Ok(std) => std,
            Err(e) => {
                tracing::warn!(error = %e, "cannot hand a client to a worker");
                return;
            }
        };
        self.loops.spawn(
            turn,
            Box::pin(async move {
                match std.register() {
                    Ok(client) => handle(client).await,
                    Err(e) => tracing::warn!(error = %e, "cannot hand a client to a worker"),
                }
            }),
        );
    }
}

/// An accepted client's socket between two event loops: taken from the accepting thread's,
/// not yet registered with its worker's.
enum Unregistered {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Unregistered {
    /// Takes a just-accepted plain socket (TCP or Unix) off this thread's event loop.
    fn take(client: Stream) -> std::io::Result<Unregistered> {
        match client {
            Stream::Tcp(tcp) => Ok(Unregistered::Tcp(tcp.into_std()?)),
            Stream::Unix(unix) => Ok(Unregistered::Unix(unix.into_std()?)),
            _ => Err(std::io::Error::other(
                "only a plain socket moves to a worker",
            )),
        }
    }

    /// Registers the socket with the calling thread's event loop.
    fn register(self) -> std::io::Result<Stream> {
        Ok(match self {
            Unregistered::Tcp(std) => Stream::Tcp(tokio::net::TcpStream::from_std(std)?),
            Unregistered::Unix(std) => {
                Stream::Unix(Box::new(tokio::net::UnixStream::from_std(std)?))
            }
        })
    }
}

/// The CPU that last processed a packet of the connection (`SO_INCOMING_CPU`): over
/// loopback, the one its client's thread ran on when it connected.
fn incoming_cpu(tcp: &tokio::net::TcpStream) -> Option<usize> {
    use std::os::fd::AsRawFd;
    let mut cpu: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a c_int and its size, for an option whose value is one c_int.
    let r = unsafe {
        libc::getsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_INCOMING_CPU,
            (&mut cpu as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (r == 0 && cpu >= 0).then_some(cpu as usize)
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
struct Stripe(std::sync::atomic::AtomicU64);

/// Workers beyond this many share stripes (of a [`StripedCounter`] or [`PoolStats`]).
pub const STRIPES: usize = 4;

/// The stripe the current worker adds to.
#[inline]
pub fn this_stripe() -> usize {
    current() as usize % STRIPES
}

impl StripedCounter {
    #[inline]
    pub fn add(&self, n: u64) {
        self.0[this_stripe()]
            .0
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0
            .iter()
            .map(|s| s.0.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }
}
