//! The `pgmemo` command: parse flags, build the configuration (or start a private PostgreSQL in
//! demo mode), run until SIGTERM/SIGINT or the admin SHUTDOWN, reload on SIGHUP.

use clap::Parser;
use pgmemo::cli::{Cli, Command};
use pgmemo::config::{AuthType, Config, LogFormat, Upstream};
use pgmemo::demo::{LocalPostgres, LocalPostgresOptions};
use pgmemo::Pgmemo;
use std::process::ExitCode;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// mimalloc, not glibc's malloc: the result cache stores and evicts entries of many sizes in
/// random order, which glibc served from its slow paths (cache_uniform.sql, 32 clients: 7.0 vs
/// 5.4 µs user CPU per miss).
///
/// Without transparent huge pages (the `no_thp` build of mimalloc, and the process's THP flag
/// cleared first thing in `main`): mimalloc asks for them on its arena, and the kernel then
/// backs it 2 MiB at a time, so every idle client cost ~2.1 KiB of RSS instead of ~1.7 and the
/// process started 8 MiB larger. Side by side (8 clients, 3 × 10 s) throughput and CPU per
/// transaction were the same either way, the result cache's miss path over a 64 MiB store
/// included (45.7–46.6k vs 46.0–47.1k TPS, 12.35–12.53 vs 12.25–12.48 µs); at one client
/// (`pgbench -S -c 1`, 6 × 10 s each) 35.7 µs without them against 35.0 with, a difference
/// inside the runs' own spread (33.4–38.0 and 34.3–36.6).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // No transparent huge pages for this process (see the allocator above), before anything
    // else touches memory. SAFETY: prctl with PR_SET_THP_DISABLE takes integer arguments only.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
    let cli = Cli::parse();
    if let Some(Command::Convert {
        ini,
        userlist,
        output,
    }) = &cli.command
    {
        return convert(ini, userlist.as_deref(), output.as_deref());
    }
    // Read once, before the runtime: whether it needs tokio's timers depends on it.
    let loaded = cli.clone().into_config();
    let tokio_timers = matches!(&loaded, Ok(Some(c)) if c.needs_tokio_timers());
    let runtime = match pgmemo::workers::event_loop(tokio_timers) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pgmemo: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let serve = async {
        pgmemo::timer::install();
        run(cli, loaded).await
    };
    match runtime.block_on(serve) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pgmemo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `pgmemo convert`: PgBouncer's configuration as pgmemo's TOML, on stdout or in `output`;
/// warnings on stderr; exit status 1 on an error.
fn convert(
    ini: &std::path::Path,
    userlist: Option<&std::path::Path>,
    output: Option<&std::path::Path>,
) -> ExitCode {
    let converted = match pgmemo::convert::convert(ini, userlist) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("pgmemo convert: {e}");
            return ExitCode::FAILURE;
        }
    };
    for warning in &converted.warnings {
        eprintln!("pgmemo convert: warning: {warning}");
    }
    let written = match output {
        Some(path) => std::fs::write(path, &converted.toml)
            .map_err(|e| format!("cannot write {}: {e}", path.display())),
        None => {
            use std::io::Write;
            std::io::stdout()
                .write_all(converted.toml.as_bytes())
                .map_err(|e| format!("cannot write to stdout: {e}"))
        }
    };
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pgmemo convert: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The open-files limit before and after [`raise_file_limit`].
struct FileLimit {
    soft_before: libc::rlim_t,
    soft: libc::rlim_t,
    hard: libc::rlim_t,
    error: Option<std::io::Error>,
}

/// Raises the soft limit on open files (RLIMIT_NOFILE) to the hard limit: every client and
/// every server connection is a file descriptor, and the soft limit many systems start a
/// process with (1024) would refuse the 1025th client with EMFILE well below
/// `max_client_conn`. The hard limit is the operator's to set (systemd's `LimitNOFILE`,
/// `ulimit -Hn`, Docker's `--ulimit nofile`) and pgmemo takes all of it, so that the unit's
/// `LimitNOFILE` is the only knob. PgBouncer logs both limits ("kernel file descriptor limit")
/// but leaves raising the soft one to whoever starts it.
fn raise_file_limit() -> FileLimit {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write only the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        let error = Some(std::io::Error::last_os_error());
        return FileLimit {
            soft_before: 0,
            soft: 0,
            hard: 0,
            error,
        };
    }
    let soft_before = limit.rlim_cur;
    let mut error = None;
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = limit.rlim_max;
        } else {
            error = Some(std::io::Error::last_os_error());
        }
    }
    FileLimit {
        soft_before,
        soft: limit.rlim_cur,
        hard: limit.rlim_max,
        error,
    }
}

fn log_file_limit(limit: FileLimit) {
    let show = |n: libc::rlim_t| match n {
        libc::RLIM_INFINITY => "unlimited".to_string(),
        n => n.to_string(),
    };
    let (before, soft, hard) = (show(limit.soft_before), show(limit.soft), show(limit.hard));
    match limit.error {
        None if limit.soft_before < limit.soft => {
            tracing::info!("open files limit: soft {before} raised to {soft} (hard limit {hard})")
        }
        None => tracing::info!("open files limit: soft {soft}, hard {hard}"),
        Some(e) => tracing::warn!(
            "open files limit: soft {soft}, hard {hard}; raising the soft limit failed: {e}"
        ),
    }
}

fn init_logging(level: &str, format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("PGMEMO_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_new(level))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logger = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        // Colour codes only for a person at a terminal: not in files, journald or pipes.
        LogFormat::Text => logger.with_ansi(std::io::stderr().is_terminal()).try_init(),
        LogFormat::Json => logger.json().with_ansi(false).try_init(),
    };
}

/// The configuration of demo mode, in front of the private cluster at `host:port`: at start
/// and again at each reload.
fn demo_config(cli: &Cli, host: String, port: u16) -> anyhow::Result<Config> {
    let mut config = Config::for_upstream(Upstream {
        host,
        port,
        user: "postgres".into(),
        password: None,
        ..Default::default()
    });
    // The private cluster trusts loopback logins; so does pgmemo in front of it unless asked
    // otherwise.
    if cli.auth.is_none() {
        config.general.auth_type = AuthType::Trust;
    }
    config.general.admin_users = vec!["postgres".into()];
    // Demo mode shows pgmemo's main job: the result cache is on (for hinted queries; no rules).
    config.cache.enabled = true;
    cli.apply_overrides(&mut config)?;
    Ok(config)
}

/// The signals pgmemo acts on, caught from before it starts.
struct Signals {
    hup: Signal,
    term: Signal,
    int: Signal,
    quit: Signal,
    usr1: Signal,
    usr2: Signal,
}

impl Signals {
    fn catch() -> std::io::Result<Signals> {
        Ok(Signals {
            hup: signal(SignalKind::hangup())?,
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            quit: signal(SignalKind::quit())?,
            usr1: signal(SignalKind::user_defined1())?,
            usr2: signal(SignalKind::user_defined2())?,
        })
    }

    /// Acts on signals until `pgmemo` has shut down. PgBouncer's meanings (1.23 and later):
    /// SIGHUP reloads; SIGTERM waits for the clients to leave, SIGINT for the transactions
    /// to finish; either during a shutdown, and SIGQUIT, exit at once; SIGUSR1/SIGUSR2 pause
    /// and resume every database.
    async fn serve(mut self, pgmemo: Pgmemo) {
        let app = pgmemo.app().clone();
        let immediate = |why: &str| {
            tracing::info!("{why}: immediate shutdown");
            pgmemo::service::stopping();
            app.begin_shutdown();
            app.cut_off();
        };
        let stopping = || app.is_shutting_down() || app.is_draining();
        let waiting = pgmemo.wait();
        tokio::pin!(waiting);
        loop {
            tokio::select! {
                _ = &mut waiting => return,
                _ = self.hup.recv() => match pgmemo::reload(&app) {
                    Ok(_) => tracing::info!("SIGHUP: configuration reloaded"),
                    Err(e) => tracing::error!("SIGHUP: reload failed, keeping the old configuration: {e:#}"),
                },
                _ = self.term.recv() => {
                    if stopping() {
                        immediate("SIGTERM during a shutdown");
                    } else {
                        tracing::info!("SIGTERM: shutting down once every client has disconnected (no new clients)");
                        pgmemo::service::stopping();
                        app.begin_drain();
                    }
                }
                _ = self.int.recv() => {
                    if stopping() {
                        immediate("SIGINT during a shutdown");
                    } else {
                        tracing::info!("SIGINT: shutting down once the running transactions have finished");
                        pgmemo::service::stopping();
                        app.begin_shutdown();
                    }
                }
                _ = self.quit.recv() => immediate("SIGQUIT"),
                _ = self.usr1.recv() => {
                    tracing::info!("SIGUSR1: pausing every database");
                    app.pause_databases(None);
                }
                _ = self.usr2.recv() => {
                    tracing::info!("SIGUSR2: resuming every database");
                    if let Err(e) = app.resume_databases(None) {
                        tracing::warn!("SIGUSR2: {e}");
                    }
                }
            }
        }
    }
}

/// `--takeover`: the control socket of the pgmemo running with this configuration.
fn take_over_from(config: &Config) -> anyhow::Result<std::path::PathBuf> {
    // Valid: the configuration was checked.
    let port = pgmemo::config::parse_host_port(&config.general.listen).map_or(0, |(_, p)| p);
    let Some(path) = pgmemo::takeover::control_path(&config.general, port) else {
        anyhow::bail!("--takeover: general.online_restart is off in this configuration");
    };
    if port == 0 && config.general.takeover_socket.is_none() {
        anyhow::bail!("--takeover: listen's port is 0, so set general.takeover_socket");
    }
    Ok(path)
}

/// Serves `cli`, whose configuration `loaded` is (read once in `main`).
async fn run(
    cli: Cli,
    loaded: Result<Option<pgmemo::config::Config>, pgmemo::config::ConfigError>,
) -> anyhow::Result<()> {
    let check_only = cli.check;
    let (config, demo) = match loaded? {
        Some(config) => (config, None),
        // --check validates and starts nothing, least of all a private PostgreSQL.
        None if check_only => anyhow::bail!(
            "--check: there is no configuration to check; give --config FILE or --upstream URL \
             (without either, pgmemo runs demo mode, which --check never starts)"
        ),
        None => {
            // Demo mode: a private throwaway PostgreSQL, removed again when pgmemo exits.
            init_logging(
                cli.log_level.as_deref().unwrap_or("info"),
                cli.log_format.unwrap_or_default(),
            );
            eprintln!("pgmemo: no --upstream or --config given: starting a private PostgreSQL (demo mode)");
            let cluster = tokio::task::spawn_blocking(|| {
                LocalPostgres::start(LocalPostgresOptions::default())
            })
            .await??;
            let cluster = tokio::task::spawn_blocking(move || {
                pgmemo::tour::load_sample(&cluster).map(|()| cluster)
            })
            .await??;
            let config = demo_config(&cli, cluster.host().to_owned(), cluster.port())?;
            (config, Some(cluster))
        }
    };
    init_logging(&config.general.log_level, config.general.log_format);
    for notice in config.notices() {
        match check_only {
            true => eprintln!("pgmemo: warning: {notice}"),
            false => tracing::warn!("{notice}"),
        }
    }
    if check_only {
        // The rules against the databases they apply to (a rule that can never match).
        let app = pgmemo::app::App::new(config)?;
        let found = pgmemo::rule_check::check(&app).await;
        for warning in &found.warnings {
            eprintln!("pgmemo: warning: {warning}");
        }
        for e in &found.errors {
            eprintln!("pgmemo: {e}");
        }
        if !found.errors.is_empty() {
            anyhow::bail!("{} cache rule(s) can never match", found.errors.len());
        }
        println!("configuration OK");
        return Ok(());
    }
    // Signals are caught from here on: one that arrives while pgmemo starts is acted on once
    // it runs, instead of killing it half-started.
    let signals = Signals::catch()?;
    log_file_limit(raise_file_limit());
    let takeover = match cli.takeover && demo.is_none() {
        true => Some(take_over_from(&config)?),
        false => None,
    };
    let pgmemo = Pgmemo::start_with(config, takeover.as_deref()).await?;
    // Under systemd (Type=notify): listening now; after a takeover this process is the main one.
    pgmemo::service::ready();
    let reload_cli = cli.clone();
    let demo_upstream = demo.as_ref().map(|c| (c.host().to_owned(), c.port()));
    pgmemo.set_reloader(Box::new(move || {
        let config = match reload_cli.clone().into_config()? {
            Some(c) => c,
            None => {
                let (host, port) = demo_upstream.clone().expect("demo mode has a cluster");
                demo_config(&reload_cli, host, port)?
            }
        };
        Ok(config)
    }));
    let addr = pgmemo.local_addr();
    if let Some(cluster) = demo.as_ref() {
        println!("{}", pgmemo::tour::banner(addr, cluster));
    }
    let demo_bench = match demo.as_ref() {
        Some(cluster) if cli.demo_bench => {
            println!("--demo-bench: two 10-second pgbench runs, through pgmemo and directly ...");
            let (host, port, bin) = (
                cluster.host().to_owned(),
                cluster.port(),
                cluster.bin_dir().to_owned(),
            );
            Some(tokio::task::spawn_blocking(
                move || match pgmemo::tour::compare(&host, port, &bin, addr) {
                    Ok(comparisons) => {
                        for c in comparisons {
                            println!(
                                "{}, 8 clients, 10 s: {:.0} TPS through pgmemo, {:.0} TPS \
                                 directly ({:.2}x)",
                                c.what,
                                c.through,
                                c.direct,
                                c.through / c.direct
                            );
                        }
                    }
                    Err(e) => eprintln!("--demo-bench: {e:#}"),
                },
            ))
        }
        _ => None,
    };
    signals.serve(pgmemo).await;
    if let Some(bench) = demo_bench {
        bench.abort();
    }
    if let Some(mut cluster) = demo {
        tokio::task::spawn_blocking(move || cluster.stop()).await?;
    }
    Ok(())
}
