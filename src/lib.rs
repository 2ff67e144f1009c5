//! pgmemo: a PostgreSQL proxy and connection pooler built for caching statements, plans and
//! results. See README.md for what it does and DESIGN notes in the modules for how.
//!
//! The binary is a thin shell over [`Pgmemo`], which tests and benchmarks embed directly.

// Built and tested on Linux only: the workers ask the kernel which CPU a connection arrived on
// (SO_INCOMING_CPU, workers.rs) and the binary turns transparent huge pages off with prctl
// (main.rs). Say so at compile time rather than with a missing symbol.
#[cfg(not(target_os = "linux"))]
compile_error!(
    "pgmemo builds and runs on Linux only (it uses SO_INCOMING_CPU and prctl); \
     see docs/operations.md"
);

pub mod admin;
pub mod app;
pub mod auth;
pub mod auth_query;
pub mod autoprepare;
pub mod budget;
pub mod buffers;
pub mod cache;
pub mod cancel;
pub mod cli;
pub mod clock;
pub mod config;
pub mod connection;
pub mod convert;
pub mod demo;
pub mod handoff;
pub mod keepalive;
pub mod listen;
pub mod lsn;
pub mod metrics;
pub mod params;
pub mod pins;
pub mod pool;
pub mod primary;
pub mod protocol;
pub mod query;
pub mod replicas;
pub mod replies;
pub mod rule_check;
pub mod server;
pub mod service;
pub mod session;
pub mod statements;
pub mod stats;
pub mod stream;
pub mod takeover;
pub mod timeouts;
pub mod timer;
pub mod tls;
pub mod tour;
pub mod vacate;
pub mod wal;
pub mod workers;

use anyhow::Context as _;
use app::App;
use config::Config;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// A running pgmemo: its listener, janitor and (optionally) metrics endpoint.
pub struct Pgmemo {
    app: Arc<App>,
    addr: SocketAddr,
    unix_socket: Option<std::path::PathBuf>,
    metrics_addr: Option<SocketAddr>,
    accept_task: tokio::task::JoinHandle<()>,
    /// Kept until [`Pgmemo::wait`] has seen every client go: the extra workers' event loops
    /// stop when the last holder (this, or the accept loop while it runs) drops it.
    workers: Arc<workers::Workers>,
    /// Where a successor asks to take over (`online_restart`); its file goes with it.
    control: Option<takeover::ControlSocket>,
}

/// Builds the configuration again on RELOAD / SIGHUP (re-reads the file, re-applies flags).
pub type Reloader = Box<dyn Fn() -> anyhow::Result<Config> + Send + Sync>;

impl Pgmemo {
    /// Binds `general.listen` (port 0 picks a free port) and starts serving.
    pub async fn start(config: Config) -> anyhow::Result<Pgmemo> {
        Pgmemo::start_with(config, None).await
    }

    /// Starts serving; with `takeover_from`, on the listening sockets of the pgmemo whose
    /// control socket that is, whose clients it then takes over (an online restart, see
    /// [`takeover`]), or as usual when no pgmemo answers there. The takeover is asked for
    /// once everything that may fail here has been set up (TLS files, worker threads): a
    /// process that fails to start after it has taken the sockets would leave nobody
    /// listening.
    pub async fn start_with(
        config: Config,
        takeover_from: Option<&std::path::Path>,
    ) -> anyhow::Result<Pgmemo> {
        // This loop's timers (pgmemo's main thread has them already; a test's runtime gets
        // them here).
        timer::install();
        let listen = config.general.listen.clone();
        let metrics_listen = config.general.metrics_listen.clone();
        let tokio_timers = config.needs_tokio_timers();
        let workers = Arc::new(
            workers::Workers::start(config.general.workers as usize, tokio_timers)
                .context("cannot start the worker threads")?,
        );
        let app = App::new(config)?;
        let _ = app.workers.set(workers.loops());
        let mut inherited = takeover_from.map(ask_takeover).transpose()?.flatten();
        let (listener, unix, metrics) = match inherited.as_mut() {
            Some(inherited) => inherited.take_listeners(&listen)?,
            None => (
                TcpListener::bind(&listen)
                    .await
                    .with_context(|| format!("cannot listen on {listen}"))?,
                None,
                None,
            ),
        };
        let addr = listener.local_addr()?;
        *app.listen_addr.lock() = Some(addr);
        let config = app.config.load();
        let general = &config.general;
        let took_over = inherited.is_some();
        let (unix, metrics) = side_listeners(
            general,
            addr.port(),
            unix,
            metrics,
            metrics_listen,
            took_over,
        )
        .await?;
        let control_path = takeover::control_path(general, addr.port());
        drop(config);
        let unix_socket = unix.as_ref().map(|u| u.path().to_owned());
        let control = match control_path {
            Some(path) => {
                let fds = takeover::ListenerFds::duplicate(
                    &listener,
                    unix.as_ref().map(|u| (u.listener(), u.path())),
                    metrics.as_ref(),
                );
                match fds {
                    Ok(fds) => takeover::listen(app.clone(), path, fds),
                    Err(e) => {
                        tracing::warn!(error = %e, "online restart is off: cannot duplicate the listening sockets");
                        None
                    }
                }
            }
            None => None,
        };
        let metrics_addr = match metrics {
            Some(l) => {
                let a = l.local_addr()?;
                tokio::spawn(metrics::serve(app.clone(), l));
                Some(a)
            }
            None => None,
        };
        tokio::spawn(janitor(app.clone()));
        let accept_task = tokio::spawn(accept_loop(app.clone(), listener, unix, workers.clone()));
        match &unix_socket {
            Some(path) => tracing::info!(%addr, socket = %path.display(), "pgmemo listening"),
            None => tracing::info!(%addr, "pgmemo listening"),
        }
        if let Some(inherited) = inherited {
            tracing::info!(
                "took over the listening sockets; the old process hands its clients over"
            );
            inherited.follow(
                app.clone(),
                tokio::runtime::Handle::current(),
                connection::resume_client,
            );
        }
        Ok(Pgmemo {
            app,
            addr,
            unix_socket,
            metrics_addr,
            accept_task,
            workers,
            control,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The Unix socket file pgmemo listens on (`unix_socket_dir`), if any.
    pub fn unix_socket(&self) -> Option<&std::path::Path> {
        self.unix_socket.as_deref()
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    pub fn app(&self) -> &Arc<App> {
        &self.app
    }

    /// Sets how RELOAD and SIGHUP obtain a fresh configuration.
    pub fn set_reloader(&self, reloader: Reloader) {
        *self.app.reloader.lock() = Some(reloader);
    }

    /// Applies `config` now, as RELOAD would; returns the changed settings that wait for a
    /// restart.
    pub fn reload_with(&self, config: Config) -> anyhow::Result<Vec<config::PendingRestart>> {
        self.app.reload(config)
    }

    /// Stops accepting, lets running transactions finish (up to shutdown_timeout), then
    /// closes every connection.
    pub async fn shutdown(self) {
        self.app.begin_shutdown();
        self.wait().await;
    }

    /// Waits until a shutdown (SIGTERM, the SHUTDOWN command, or [`Pgmemo::shutdown`]) has
    /// completed.
    pub async fn wait(self) {
        self.until_shutdown().await;
        let _ = self.accept_task.await;
        let timeout = self.app.config.load().general.shutdown_timeout;
        let deadline = Instant::now() + timeout;
        while self.app.client_count() > 0 && Instant::now() < deadline {
            crate::timer::sleep(Duration::from_millis(20)).await;
        }
        // Every client is gone, or shutdown_timeout has passed: cut off the sessions still in
        // a transaction (each rolls back and closes its server) and close the pools, which
        // also fails the checkouts of clients still queued.
        if self.app.client_count() > 0 {
            tracing::warn!(
                clients = self.app.client_count(),
                "shutdown_timeout passed: closing clients still in a transaction"
            );
        }
        self.app.cut_off();
        for pool in self.app.pools() {
            pool.close().await;
        }
        let grace = Instant::now() + Duration::from_secs(5);
        while self.app.client_count() > 0 && Instant::now() < grace {
            crate::timer::sleep(Duration::from_millis(20)).await;
        }
        // An online restart: every client handed over is written to the new process before
        // this one exits (their sockets close with it).
        let grace = Instant::now() + Duration::from_secs(5);
        while self.app.handoff.in_flight() > 0 && Instant::now() < grace {
            crate::timer::sleep(Duration::from_millis(5)).await;
        }
        self.app.handoff.close();
        if let Some(clients) = self.app.handoff.handed() {
            tracing::info!(clients, "takeover: done");
        }
        drop(self.control);
        drop(self.workers);
        tracing::info!("pgmemo stopped");
    }
}

impl Pgmemo {
    /// Returns once a shutdown has begun. Before that, when pgmemo stops accepting without
    /// one (`SHUTDOWN WAIT_FOR_CLIENTS`, or an online restart handing the clients over), the
    /// clients here are served until the last one has gone, then the shutdown begins; an
    /// online restart begins it after `shutdown_timeout` too (for clients that cannot
    /// move), and goes back to serving if the new process went away (it accepts again).
    async fn until_shutdown(&self) {
        let app = &self.app;
        let mut accepting = app.accepting_signal();
        let mut shutdown = app.shutdown_signal();
        loop {
            let _ = accepting.wait_for(|accepting| !*accepting).await;
            if app.is_shutting_down() {
                return;
            }
            let timeout = app.config.load().general.shutdown_timeout;
            let deadline = app.is_handing_over().then(|| Instant::now() + timeout);
            loop {
                if app.client_count() == 0 || app.is_shutting_down() {
                    app.begin_shutdown();
                    return;
                }
                if *accepting.borrow_and_update() {
                    break; // the new process went away: serving again
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    tracing::warn!(
                        clients = app.client_count(),
                        "takeover: shutdown_timeout passed; closing the clients that could not move"
                    );
                    app.begin_shutdown();
                    return;
                }
                tokio::select! {
                    _ = crate::timer::sleep(Duration::from_millis(20)) => {}
                    _ = shutdown.wait_for(|s| *s) => {}
                    _ = accepting.changed() => {}
                }
            }
        }
    }
}

/// `--takeover`: the listening sockets of the pgmemo whose control socket is at `path`, or
/// None when none answers there.
fn ask_takeover(path: &std::path::Path) -> anyhow::Result<Option<takeover::Inherited>> {
    let inherited = takeover::take_over(path)?;
    match &inherited {
        Some(_) => {
            tracing::info!(socket = %path.display(), "--takeover: taking over from the running pgmemo")
        }
        None => {
            tracing::info!(socket = %path.display(), "--takeover: no pgmemo answers there; starting as usual")
        }
    }
    Ok(inherited)
}

/// The Unix socket and the metrics endpoint: the ones taken over, else opened as the
/// configuration says. After a takeover (`took_over`) a socket the old process did not have
/// is an extra: failing to open it must not stop the process that now holds the listeners.
async fn side_listeners(
    general: &config::General,
    port: u16,
    unix: Option<listen::UnixSocket>,
    metrics: Option<TcpListener>,
    metrics_listen: Option<String>,
    took_over: bool,
) -> anyhow::Result<(Option<listen::UnixSocket>, Option<TcpListener>)> {
    let unix = match (&general.unix_socket_dir, unix) {
        (_, Some(unix)) => Some(unix),
        (Some(dir), None) => {
            let bound = config::parse_mode(&general.unix_socket_mode)
                .map_err(anyhow::Error::msg)
                .and_then(|mode| {
                    let group = general.unix_socket_group.as_deref();
                    listen::UnixSocket::bind(dir, port, mode, group)
                });
            match bound {
                Ok(unix) => Some(unix),
                Err(e) if took_over => {
                    tracing::warn!("no Unix socket after the takeover: {e:#}");
                    None
                }
                Err(e) => return Err(e),
            }
        }
        _ => None,
    };
    let metrics = match (metrics, metrics_listen) {
        (Some(l), _) => Some(l),
        (None, Some(m)) => match TcpListener::bind(&m).await {
            Ok(l) => Some(l),
            Err(e) if took_over => {
                tracing::warn!("no metrics endpoint after the takeover: cannot listen on metrics_listen {m}: {e}");
                None
            }
            Err(e) => {
                return Err(e).with_context(|| format!("cannot listen on metrics_listen {m}"))
            }
        },
        _ => None,
    };
    Ok((unix, metrics))
}

/// RELOAD: rebuilds the configuration with the registered reloader and applies it; returns
/// the changed settings that wait for a restart (see [`App::reload`]).
pub fn reload(app: &App) -> anyhow::Result<Vec<config::PendingRestart>> {
    let config = match app.reloader.lock().as_ref() {
        Some(reloader) => reloader()?,
        None => (**app.config.load()).clone(),
    };
    app.reload(config)
}

/// Accepts clients, on TCP and on the Unix socket if there is one, and deals them to the
/// workers. Returning drops the listeners, which removes the socket file.
async fn accept_loop(
    app: Arc<App>,
    listener: TcpListener,
    unix: Option<listen::UnixSocket>,
    workers: Arc<workers::Workers>,
) {
    let mut accepting = app.accepting_signal();
    let mut unix = unix;
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => Some(r.map(|(tcp, _)| stream::Stream::Tcp(tcp))),
            // An async block runs only when polled, which the guard keeps from a None.
            r = async { unix.as_ref().expect("guarded").accept().await }, if unix.is_some() => Some(r),
            _ = accepting.wait_for(|accepting| !*accepting) => None,
        };
        let Some(accepted) = accepted else {
            if !app.is_handing_over() {
                return;
            }
            // An online restart: the new process accepts on these sockets now. They are
            // kept, not accepted on, until this process exits (the Unix socket's file stays:
            // the new process listens on it), or until the new process goes away before it
            // has every client: then this one accepts again.
            let mut shutdown = app.shutdown_signal();
            tokio::select! {
                _ = accepting.wait_for(|accepting| *accepting) => continue,
                _ = shutdown.wait_for(|s| *s) => {}
            }
            if let Some(unix) = unix.as_mut() {
                unix.leave_file();
            }
            return;
        };
        match accepted {
            Ok(client) => {
                if let stream::Stream::Tcp(tcp) = &client {
                    if let Err(e) = keepalive::apply(tcp, &app.config.load().general.keepalive()) {
                        tracing::debug!(error = %e, "could not set TCP keepalive");
                    }
                }
                let app = app.clone();
                workers.serve(client, move |client| connection::serve_client(app, client));
            }
            Err(e) => {
                // Usually EMFILE: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                crate::timer::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Periodic pool maintenance: idle and lifetime limits, min_pool_size.
/// Runs once at once, then every second (on a [`timer::Ticker`]: no timer of the event
/// loop's).
async fn janitor(app: Arc<App>) {
    let mut shutdown = app.shutdown_signal();
    let mut ticker = timer::Ticker::every(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
        let (period, log_stats) = {
            let g = &app.config.load().general;
            (g.stats_period, g.log_stats)
        };
        timeouts::enforce(&app);
        let pools = app.pools();
        for pool in &pools {
            pool.maintain().await;
            pool.stats_periods
                .roll(std::time::Instant::now(), period, || pool.stats.snapshot());
        }
        for set in app.replica_sets() {
            for replica in set.members().iter() {
                replica.pool.maintain().await;
            }
        }
        let rolled = app.stats_log.roll(std::time::Instant::now(), period, || {
            let mut all = crate::stats::StatsSnapshot::default();
            pools.iter().for_each(|p| all.add(&p.stats.snapshot()));
            all
        });
        if rolled && log_stats {
            tracing::info!("{}", app.stats_log.last_line());
        }
        // Cheap unless many clients left since the last purge (two-phase purge).
        app.registry.purge(64);
        app.cache.choose_automatically();
    }
}
