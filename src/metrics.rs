//! The Prometheus endpoint: `GET /metrics` on `metrics_listen`, in the text exposition format,
//! and `GET /health` for load balancers and orchestrators (see [`health`]).
//!
//! Scrapes are rare and tiny, so this is a minimal HTTP/1.1 responder on a plain TcpListener
//! rather than a web framework: read the request head, answer, close.

use crate::app::{App, ClientState};
use crate::server::ServerState;
use std::fmt::Write as _;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

pub async fn serve(app: Arc<App>, listener: TcpListener) {
    let mut shutdown = app.shutdown_signal();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let Ok((mut sock, _)) = accepted else {
            continue;
        };
        let app = app.clone();
        tokio::spawn(async move {
            let mut head = Vec::with_capacity(1024);
            let mut buf = [0u8; 1024];
            // Read the request head, bounded in size and time.
            let read = crate::timer::timeout(std::time::Duration::from_secs(5), async {
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                true
            })
            .await;
            if !matches!(read, Ok(true)) {
                return;
            }
            let request_line = head.split(|&b| b == b'\r').next().unwrap_or_default();
            let (status, body) = if request_line.starts_with(b"GET /metrics ")
                || request_line.starts_with(b"GET / ")
            {
                ("200 OK", render(&app))
            } else if request_line.starts_with(b"GET /health ") {
                match health(&app).await {
                    Ok(body) => ("200 OK", body),
                    Err(body) => ("503 Service Unavailable", body),
                }
            } else {
                (
                    "404 Not Found",
                    "not found; try /metrics or /health\n".to_owned(),
                )
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(response.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

fn labels(database: &str, user: &str) -> String {
    format!(
        "database=\"{}\",user=\"{}\"",
        escape(database),
        escape(user)
    )
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A counter: its name, its help text, and how to read it from a pool's statistics.
type Counter = (
    &'static str,
    &'static str,
    fn(&crate::stats::StatsSnapshot) -> f64,
);

/// Renders every metric. The same numbers as SHOW POOLS and SHOW STATS.
pub fn render(app: &App) -> String {
    let mut out = String::new();
    let pools = app.pools();
    let _ = writeln!(
        out,
        "# HELP pgmemo_build_info pgmemo's version (always 1).\n# TYPE pgmemo_build_info gauge\npgmemo_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    error_metrics(app, &mut out);
    pool_gauges(app, &pools, &mut out);
    pool_counters(&pools, &mut out);
    replica_metrics(app, &mut out);
    pool_histograms(&pools, &mut out);
    autoprepare_metrics(app, &mut out);
    pin_metrics(app, &pools, &mut out);
    cache_metrics(app, &mut out);
    query_metrics(app, &mut out);
    let _ = writeln!(
        out,
        "# HELP pgmemo_uptime_seconds Seconds since start.\n# TYPE pgmemo_uptime_seconds gauge\npgmemo_uptime_seconds {}",
        app.started.elapsed().as_secs()
    );
    out
}

type Pools = [Arc<crate::pool::Pool>];

/// Errors that belong to no pool: failed client logins by reason, max_client_conn refusals.
/// (Per pool: pgmemo_server_connect_failures_total, pgmemo_wait_timeouts_total.)
fn error_metrics(app: &App, out: &mut String) {
    let _ = writeln!(
        out,
        "# HELP pgmemo_client_login_failures_total Client logins that failed, by reason.\n# TYPE pgmemo_client_login_failures_total counter"
    );
    for (why, n) in app.errors.login_failures() {
        let _ = writeln!(
            out,
            "pgmemo_client_login_failures_total{{reason=\"{}\"}} {n}",
            why.as_str()
        );
    }
    let _ = writeln!(
        out,
        "# HELP pgmemo_max_client_conn_refusals_total Clients turned away at max_client_conn.\n# TYPE pgmemo_max_client_conn_refusals_total counter\npgmemo_max_client_conn_refusals_total {}",
        app.errors
            .max_client_conn
            .load(std::sync::atomic::Ordering::Relaxed)
    );
}

/// How long [`health`] waits for each upstream to answer.
const HEALTH_CHECK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// `GET /health`: Ok (200) when pgmemo's listener runs and every configured upstream
/// answered the check this request made, Err (503) with the reasons otherwise; the body
/// says which, a line each.
///
/// The check of an upstream (each distinct host and port of the configured databases and
/// the pools in use) is PostgreSQL's cheapest exchange: an SSLRequest, answered by one byte
/// (`S` or `N`) by any PostgreSQL that accepts connections, without a login (and without a
/// line in PostgreSQL's log). Each is made at most [`HEALTH_CHECK_TIMEOUT`] long, all at
/// once.
pub async fn health(app: &App) -> Result<String, String> {
    let mut problems = Vec::new();
    let mut fine = Vec::new();
    match *app.listen_addr.lock() {
        Some(addr) if !app.is_shutting_down() => fine.push(format!("listener {addr}: running")),
        Some(addr) => problems.push(format!("listener {addr}: shutting down")),
        None => problems.push("listener: not running".to_string()),
    }
    let mut checks = tokio::task::JoinSet::new();
    for (host, port) in upstreams(app) {
        checks.spawn(async move {
            let answer =
                crate::timer::timeout(HEALTH_CHECK_TIMEOUT, ssl_request(&host, port)).await;
            let verdict = match answer {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {HEALTH_CHECK_TIMEOUT:?}")),
            };
            (host, port, verdict)
        });
    }
    let mut verdicts = checks.join_all().await;
    verdicts.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    for (host, port, verdict) in verdicts {
        match verdict {
            Ok(()) => fine.push(format!("upstream {host}:{port}: answered")),
            Err(e) => problems.push(format!("upstream {host}:{port}: {e}")),
        }
    }
    let mut body = problems.join("\n");
    if problems.is_empty() {
        body = format!("ok\n{}\n", fine.join("\n"));
        Ok(body)
    } else {
        body.push('\n');
        body.push_str(&fine.join("\n"));
        body.push('\n');
        Err(body)
    }
}

/// The distinct upstream servers: those of the configured databases (any name, when only
/// `[upstream]` or a `"*"` entry is configured) and of the pools in use.
fn upstreams(app: &App) -> Vec<(String, u16)> {
    let config = app.config.load();
    let mut names: Vec<&str> = config.databases.keys().map(String::as_str).collect();
    if names.is_empty()
        || config
            .databases
            .contains_key(crate::config::WILDCARD_DATABASE)
    {
        names.push("postgres"); // served from [upstream] or "*", as any other name
    }
    let mut targets: Vec<(String, u16)> = names
        .into_iter()
        .filter_map(|name| config.resolve(name, ""))
        .map(|db| (db.host, db.port))
        .chain(app.pools().iter().map(|p| {
            let t = &p.settings().target;
            (t.host.clone(), t.port)
        }))
        .collect();
    targets.sort();
    targets.dedup();
    targets
}

/// Sends PostgreSQL an SSLRequest and reads its one-byte answer.
async fn ssl_request(host: &str, port: u16) -> std::io::Result<()> {
    let mut sock = tokio::net::TcpStream::connect((host, port)).await?;
    sock.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await?;
    let mut answer = [0u8; 1];
    sock.read_exact(&mut answer).await?;
    match answer[0] {
        b'S' | b'N' => Ok(()),
        other => Err(std::io::Error::other(format!(
            "answered {other:#04x}, not as PostgreSQL does"
        ))),
    }
}

/// Clients and servers by pool and state, and the clients queued.
fn pool_gauges(app: &App, pools: &Pools, out: &mut String) {
    let clients = app.clients();

    out.push_str("# HELP pgmemo_clients Client connections by pool and state.\n# TYPE pgmemo_clients gauge\n");
    for pool in pools {
        for state in [ClientState::Idle, ClientState::Waiting, ClientState::Active] {
            let n = clients
                .iter()
                .filter(|c| {
                    *c.database == *pool.key.database
                        && *c.user == *pool.key.user
                        && c.state() == state
                })
                .count();
            let _ = writeln!(
                out,
                "pgmemo_clients{{{},state=\"{}\"}} {n}",
                labels(&pool.key.database, &pool.key.user),
                state.name()
            );
        }
    }
    out.push_str("# HELP pgmemo_servers Server connections by pool and state.\n# TYPE pgmemo_servers gauge\n");
    for pool in pools {
        let servers = pool.servers();
        for state in [
            ServerState::Login,
            ServerState::Idle,
            ServerState::Active,
            ServerState::Used,
            ServerState::Tested,
        ] {
            let n = servers.iter().filter(|s| s.state() == state).count();
            let _ = writeln!(
                out,
                "pgmemo_servers{{{},state=\"{}\"}} {n}",
                labels(&pool.key.database, &pool.key.user),
                state.name()
            );
        }
    }
    out.push_str("# HELP pgmemo_switchovers_total Times the primary of a pool's hosts moved to another host (target_session_attrs read-write or primary).\n# TYPE pgmemo_switchovers_total counter\n");
    for pool in pools {
        let _ = writeln!(
            out,
            "pgmemo_switchovers_total{{{}}} {}",
            labels(&pool.key.database, &pool.key.user),
            pool.settings().target.primary.switchovers()
        );
    }
    out.push_str("# HELP pgmemo_clients_waiting Clients queued for a server.\n# TYPE pgmemo_clients_waiting gauge\n");
    for pool in pools {
        let (_, _, waiting) = pool.counts();
        let _ = writeln!(
            out,
            "pgmemo_clients_waiting{{{}}} {waiting}",
            labels(&pool.key.database, &pool.key.user)
        );
    }
}

/// Each replica of each pool that has some: up, lag, reads routed (SHOW REPLICAS).
fn replica_metrics(app: &App, out: &mut String) {
    let sets = app.replica_sets();
    if sets.is_empty() {
        return;
    }
    let replicas: Vec<_> = sets
        .iter()
        .flat_map(|set| {
            let key = &set.key;
            set.members()
                .iter()
                .map(|r| {
                    let l = format!(
                        "{},host=\"{}\",port=\"{}\"",
                        labels(&key.database, &key.user),
                        escape(&r.host),
                        r.port
                    );
                    (l, r.clone())
                })
                .collect::<Vec<_>>()
        })
        .collect();
    out.push_str("# HELP pgmemo_replica_up Whether a replica takes reads' checks: reached, a standby, its position read.\n# TYPE pgmemo_replica_up gauge\n");
    for (l, r) in &replicas {
        let _ = writeln!(out, "pgmemo_replica_up{{{l}}} {}", u8::from(r.is_up()));
    }
    out.push_str("# HELP pgmemo_replica_lag_bytes WAL the primary wrote that a replica has not replayed.\n# TYPE pgmemo_replica_lag_bytes gauge\n");
    for (l, r) in &replicas {
        if let Some((bytes, _)) = r.lag() {
            let _ = writeln!(out, "pgmemo_replica_lag_bytes{{{l}}} {bytes}");
        }
    }
    out.push_str("# HELP pgmemo_replica_lag_seconds How long ago the primary passed a replica's replay position.\n# TYPE pgmemo_replica_lag_seconds gauge\n");
    for (l, r) in &replicas {
        if let Some((_, us)) = r.lag() {
            let _ = writeln!(out, "pgmemo_replica_lag_seconds{{{l}}} {}", us as f64 / 1e6);
        }
    }
    out.push_str("# HELP pgmemo_replica_reads_total Units of work (statements or batches) sent to a replica.\n# TYPE pgmemo_replica_reads_total counter\n");
    for (l, r) in &replicas {
        let _ = writeln!(
            out,
            "pgmemo_replica_reads_total{{{l}}} {}",
            r.reads.load(std::sync::atomic::Ordering::Relaxed)
        );
    }
}

/// The pools' counters (SHOW STATS' totals).
fn pool_counters(pools: &Pools, out: &mut String) {
    let counters: [Counter; 21] = [
        ("pgmemo_transactions_total", "Transactions pooled.", |s| {
            s.xact_count as f64
        }),
        (
            "pgmemo_queries_total",
            "Queries (ReadyForQuery) relayed.",
            |s| s.query_count as f64,
        ),
        (
            "pgmemo_received_bytes_total",
            "Bytes received from clients.",
            |s| s.bytes_received as f64,
        ),
        ("pgmemo_sent_bytes_total", "Bytes sent to clients.", |s| {
            s.bytes_sent as f64
        }),
        (
            "pgmemo_transaction_seconds_total",
            "Time servers were held by clients.",
            |s| s.xact_time_us as f64 / 1e6,
        ),
        (
            "pgmemo_query_seconds_total",
            "Time from a client's query to the ReadyForQuery answering it (SHOW STATS total_query_time).",
            |s| s.query_time_us as f64 / 1e6,
        ),
        (
            "pgmemo_server_assignments_total",
            "Times a server connection was handed to a client.",
            |s| s.server_assignments as f64,
        ),
        (
            "pgmemo_server_connects_total",
            "Server connections opened.",
            |s| s.server_connects as f64,
        ),
        (
            "pgmemo_server_connect_failures_total",
            "Attempts to open a server connection that failed (refused, timed out, login refused).",
            |s| s.server_connect_failures as f64,
        ),
        (
            "pgmemo_wait_seconds_total",
            "Time clients waited for a server.",
            |s| s.wait_time_us as f64 / 1e6,
        ),
        (
            "pgmemo_wait_timeouts_total",
            "Clients that hit query_wait_timeout.",
            |s| s.wait_timeouts as f64,
        ),
        (
            "pgmemo_client_logins_total",
            "Successful client logins.",
            |s| s.client_logins as f64,
        ),
        (
            "pgmemo_prepare_cache_hit_total",
            "Bind/Describe of a statement the server already had.",
            |s| s.prepare_cache_hit as f64,
        ),
        (
            "pgmemo_prepare_cache_miss_total",
            "Statements parsed on a server (first use there).",
            |s| s.prepare_cache_miss as f64,
        ),
        (
            "pgmemo_prepare_evictions_total",
            "Statements closed to stay within max_prepared_statements.",
            |s| s.prepare_evictions as f64,
        ),
        (
            "pgmemo_autoprepared_total",
            "Simple queries run as autoprepared statements.",
            |s| s.autoprepared as f64,
        ),
        (
            "pgmemo_autoprepare_passed_total",
            "Simple queries autoprepare passed to the server as they were.",
            |s| s.autoprepare_passed as f64,
        ),
        (
            "pgmemo_state_probes_total",
            "Servers asked what a client's transaction left in its session.",
            |s| s.state_probes as f64,
        ),
        (
            "pgmemo_serverless_batches_total",
            "Batches of Parse, Close and Sync answered without taking a server.",
            |s| s.serverless_batches as f64,
        ),
        (
            "pgmemo_server_moves_total",
            "Server connections moved to the worker thread of the client they were handed to.",
            |s| s.server_moves as f64,
        ),
        (
            "pgmemo_client_moves_total",
            "Client sessions moved to the worker thread of the CPU their client sends from.",
            |s| s.client_moves as f64,
        ),
    ];
    for (name, help, get) in counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for pool in pools {
            let s = pool.stats.snapshot();
            let _ = writeln!(
                out,
                "{name}{{{}}} {}",
                labels(&pool.key.database, &pool.key.user),
                get(&s)
            );
        }
    }
}

/// The pools' histograms (transaction and wait times).
fn pool_histograms(pools: &Pools, out: &mut String) {
    type Histogram =
        fn(&crate::stats::PoolStats) -> ([u64; crate::stats::DURATION_BUCKETS_US.len() + 1], u64);
    let histograms: [(&str, &str, Histogram); 2] = [
        (
            "pgmemo_transaction_duration_seconds",
            "How long each transaction held its server connection.",
            |s| s.xact_durations(),
        ),
        (
            "pgmemo_client_wait_seconds",
            "How long each checkout waited for a server connection.",
            |s| s.wait_durations(),
        ),
    ];
    for (name, help, get) in histograms {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for pool in pools {
            let labels = labels(&pool.key.database, &pool.key.user);
            let (counts, sum_us) = get(&pool.stats);
            for (bound, n) in crate::stats::DURATION_BUCKETS_US.iter().zip(counts) {
                let le = *bound as f64 / 1e6;
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {n}");
            }
            let total = counts[counts.len() - 1];
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {total}");
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}", sum_us as f64 / 1e6);
            let _ = writeln!(out, "{name}_count{{{labels}}} {total}");
        }
    }
}

/// Autoprepare: queries passed through by reason, shapes remembered.
fn autoprepare_metrics(app: &App, out: &mut String) {
    let _ = writeln!(
        out,
        "# HELP pgmemo_autoprepare_passed_by_reason_total Simple queries passed through, by reason.\n# TYPE pgmemo_autoprepare_passed_by_reason_total counter"
    );
    for (reason, n) in crate::autoprepare::PASS_REASONS
        .iter()
        .zip(&app.autoprepare.passed)
    {
        let _ = writeln!(
            out,
            "pgmemo_autoprepare_passed_by_reason_total{{reason=\"{reason}\"}} {}",
            n.load(std::sync::atomic::Ordering::Relaxed)
        );
    }
    let _ = writeln!(
        out,
        "# HELP pgmemo_autoprepare_shapes Query shapes remembered.\n# TYPE pgmemo_autoprepare_shapes gauge\npgmemo_autoprepare_shapes {}\n# HELP pgmemo_autoprepare_never_shapes Shapes remembered as never generalized (negative cache).\n# TYPE pgmemo_autoprepare_never_shapes gauge\npgmemo_autoprepare_never_shapes {}",
        app.autoprepare.shape_count(),
        app.autoprepare.never_count()
    );
}

/// SHOW QUERIES' first [`TOP_QUERIES`] rows (by estimated server time), labelled by
/// `query_hash` (the text stays in SHOW QUERIES: a label must stay short).
fn query_metrics(app: &App, out: &mut String) {
    let top: Vec<_> = crate::admin::query_figures(app)
        .into_iter()
        .take(TOP_QUERIES)
        .collect();
    type Get = fn(&crate::admin::QueryFigures) -> String;
    let series: [(&str, &str, &str, Get); 5] = [
        (
            "pgmemo_query_calls_total",
            "counter",
            "Queries of the shape, simple and extended (SHOW QUERIES, top by server time).",
            |q| q.calls.to_string(),
        ),
        (
            "pgmemo_query_server_seconds_total",
            "counter",
            "Estimated time on the server of the shape's queries (measured mean x calls).",
            |q| format!("{:.6}", q.total_us / 1e6),
        ),
        (
            "pgmemo_query_rows_total",
            "counter",
            "Estimated rows returned or written by the shape's queries (timed calls' mean x calls).",
            |q| format!("{:.0}", q.rows),
        ),
        (
            "pgmemo_query_cache_hits_total",
            "counter",
            "The shape's queries answered from the result cache.",
            |q| q.hits.to_string(),
        ),
        (
            "pgmemo_query_cache_misses_total",
            "counter",
            "The shape's queries run to fill the result cache.",
            |q| q.misses.to_string(),
        ),
    ];
    for (name, kind, help, get) in series {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for q in &top {
            let _ = writeln!(
                out,
                "{name}{{query_hash=\"{:016x}\"}} {}",
                q.query_hash,
                get(q)
            );
        }
    }
}

/// Queries exported by [`query_metrics`].
const TOP_QUERIES: usize = 20;

/// Session-state pins: by reason, pinned clients, pinned servers.
fn pin_metrics(app: &App, pools: &Pools, out: &mut String) {
    let _ = writeln!(
        out,
        "# HELP pgmemo_pins_total Clients pinned to their server for session state, by reason.\n# TYPE pgmemo_pins_total counter"
    );
    for pool in pools {
        let s = pool.stats.snapshot();
        for ((_, reason), n) in crate::pins::Pins::ALL.iter().zip(s.pins) {
            let _ = writeln!(
                out,
                "pgmemo_pins_total{{{},reason=\"{reason}\"}} {n}",
                labels(&pool.key.database, &pool.key.user)
            );
        }
    }
    let pinned = app
        .clients()
        .iter()
        .filter(|c| c.pins.load(std::sync::atomic::Ordering::Relaxed) != 0)
        .count();
    let _ = writeln!(
        out,
        "# HELP pgmemo_pinned_clients Clients keeping their server for session state.\n# TYPE pgmemo_pinned_clients gauge\npgmemo_pinned_clients {pinned}"
    );
    let _ = writeln!(
        out,
        "# HELP pgmemo_pinned_servers Servers held by pinned clients, by pool (at most max_pinned_fraction of pool_size).\n# TYPE pgmemo_pinned_servers gauge"
    );
    for pool in pools {
        let _ = writeln!(
            out,
            "pgmemo_pinned_servers{{{}}} {}",
            labels(&pool.key.database, &pool.key.user),
            pool.pinned_servers()
        );
    }
}

/// The result cache's counters, per rule (`(hint)`: queries chosen by a hint).
fn cache_metrics(app: &App, out: &mut String) {
    use std::sync::atomic::Ordering::Relaxed;
    let rules = app.cache.rule_stats();
    type Get = fn(&crate::cache::RuleStats) -> u64;
    let counters: [(&str, &str, Get); 6] = [
        (
            "pgmemo_cache_hits_total",
            "Queries answered from the result cache.",
            |r| r.hits.get(),
        ),
        (
            "pgmemo_cache_misses_total",
            "Cacheable queries sent to a server to fill the cache.",
            |r| r.misses.get(),
        ),
        ("pgmemo_cache_stores_total", "Results stored.", |r| {
            r.stores.load(Relaxed)
        }),
        (
            "pgmemo_cache_evictions_total",
            "Results evicted for room.",
            |r| r.evictions.load(Relaxed),
        ),
        (
            "pgmemo_cache_invalidations_total",
            "Results found invalidated by a write or expired.",
            |r| r.invalidations.load(Relaxed),
        ),
        (
            "pgmemo_cache_bypasses_total",
            "Queries a rule or hint chose that were not cached.",
            |r| r.bypasses.get(),
        ),
    ];
    for (name, help, get) in counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for r in &rules {
            let _ = writeln!(out, "{name}{{rule=\"{}\"}} {}", escape(&r.name), get(r));
        }
    }
    let _ = writeln!(
        out,
        "# HELP pgmemo_cache_bypasses_by_reason_total Queries not cached, by reason.\n# TYPE pgmemo_cache_bypasses_by_reason_total counter"
    );
    for (reason, n) in crate::query::analysis::BYPASS_REASONS
        .iter()
        .zip(&app.cache.bypasses)
    {
        let _ = writeln!(
            out,
            "pgmemo_cache_bypasses_by_reason_total{{reason=\"{}\"}} {}",
            reason.as_str(),
            n.get()
        );
    }
    let (bytes, limit) = app.cache.memory();
    let _ = writeln!(
        out,
        "# HELP pgmemo_cache_bytes Bytes held by the result cache.\n# TYPE pgmemo_cache_bytes gauge\npgmemo_cache_bytes {bytes}\n# HELP pgmemo_cache_limit_bytes The result cache's memory limit.\n# TYPE pgmemo_cache_limit_bytes gauge\npgmemo_cache_limit_bytes {limit}\n# HELP pgmemo_cache_flushes_total Whole-database or whole-cache invalidations.\n# TYPE pgmemo_cache_flushes_total counter\npgmemo_cache_flushes_total {}\n# HELP pgmemo_cache_flight_timeouts_total Misses that waited flight_wait for another client's fetch in vain.\n# TYPE pgmemo_cache_flight_timeouts_total counter\npgmemo_cache_flight_timeouts_total {}",
        app.cache.flushes.load(Relaxed),
        app.cache.flight_timeouts.load(Relaxed)
    );
    let followers = app.wal.followers();
    if !followers.is_empty() {
        let _ = writeln!(
            out,
            "# HELP pgmemo_cache_invalidation_lag_seconds Commit on the server to cached results invalidated here (WAL invalidation), over recent commits.\n# TYPE pgmemo_cache_invalidation_lag_seconds summary"
        );
        for f in &followers {
            let status = f.status();
            if let Some((p50, p99)) = status.lag_us {
                for (q, us) in [("0.5", p50), ("0.99", p99)] {
                    let _ = writeln!(
                        out,
                        "pgmemo_cache_invalidation_lag_seconds{{database=\"{}\",quantile=\"{q}\"}} {}",
                        escape(&status.database),
                        us as f64 / 1e6
                    );
                }
            }
        }
        let _ = writeln!(
            out,
            "# HELP pgmemo_cache_wal_ready Whether a database's replication stream is caught up (its results are served).\n# TYPE pgmemo_cache_wal_ready gauge"
        );
        for f in &followers {
            let _ = writeln!(
                out,
                "pgmemo_cache_wal_ready{{database=\"{}\"}} {}",
                escape(&f.database),
                u8::from(f.is_ready())
            );
        }
    }
    if let Some(shared) = app.cache.shared() {
        cache_shared(out, &shared.stats);
    }
}

/// The shared tier's counters (SHOW CACHE SHARED's).
fn cache_shared(out: &mut String, s: &crate::cache::shared::SharedStats) {
    let counters = [
        (
            "hits",
            "Misses here answered from the shared tier.",
            &s.hits,
        ),
        (
            "misses",
            "Shared tier lookups that found nothing.",
            &s.misses,
        ),
        (
            "refused",
            "Shared tier entries not served: a write known here may have committed after them.",
            &s.refused,
        ),
        (
            "errors",
            "Shared tier lookups or writes that failed.",
            &s.errors,
        ),
        (
            "timeouts",
            "Shared tier lookups that took longer than cache.shared.timeout.",
            &s.timeouts,
        ),
        ("writes", "Results written to the shared tier.", &s.writes),
        (
            "written_bytes",
            "Bytes written to the shared tier.",
            &s.bytes_written,
        ),
        (
            "writes_dropped",
            "Results not written: too many were waiting.",
            &s.dropped,
        ),
        (
            "stream_published",
            "Entries of the fleet's WAL stream this instance published as its decoder.",
            &s.stream_published,
        ),
        (
            "stream_read",
            "Entries of the fleet's WAL stream this instance read from another's decoder.",
            &s.stream_read,
        ),
    ];
    for (name, help, value) in counters {
        let _ = writeln!(
            out,
            "# HELP pgmemo_cache_shared_{name}_total {help}\n# TYPE pgmemo_cache_shared_{name}_total counter\npgmemo_cache_shared_{name}_total {}",
            value.load(std::sync::atomic::Ordering::Relaxed)
        );
    }
    let summaries = [
        ("lookup_seconds", "Shared tier lookups' round trips, recent ones.", s.latency()),
        (
            "stream_lag_seconds",
            "How long after its decoder sent them this instance read the fleet's WAL stream's entries, recent ones.",
            s.stream_lag(),
        ),
    ];
    for (name, help, quantiles) in summaries {
        let Some((p50, p99)) = quantiles else {
            continue;
        };
        let _ = writeln!(
            out,
            "# HELP pgmemo_cache_shared_{name} {help}\n# TYPE pgmemo_cache_shared_{name} summary"
        );
        for (q, us) in [("0.5", p50), ("0.99", p99)] {
            let _ = writeln!(
                out,
                "pgmemo_cache_shared_{name}{{quantile=\"{q}\"}} {}",
                us as f64 / 1e6
            );
        }
    }
}
