//! The admin console: a pseudo-database named `pgmemo` (or `pgbouncer`, PgBouncer's name for
//! it) that admin users connect to with any PostgreSQL client (`psql -d pgmemo`) to inspect
//! and steer pgmemo. Commands and column names follow PgBouncer 1.25's console so existing
//! tools (pgbouncer_exporter) and habits carry over; a column pgmemo cannot fill is said so
//! in the doc comment of its command.

use crate::app::{App, ClientState, Endpoint};
use crate::protocol::backend::{self as be, sqlstate, Severity};
use crate::protocol::frontend as fe;
use crate::server::ServerState;
use crate::session::login::Startup;
use crate::stats::StatsSnapshot;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

pub const ADMIN_DATABASE: &str = "pgmemo";

/// A result set: column names and rows of text (None = NULL).
pub struct Table {
    pub columns: Vec<&'static str>,
    pub rows: Vec<Vec<Option<String>>>,
}

/// What a console command produced.
pub enum Reply {
    Table(Table),
    /// CommandComplete only.
    Done(String),
    /// NoticeResponses (SQLSTATE, message), then CommandComplete.
    Noticed(Vec<(&'static str, String)>, String),
}

pub async fn serve(app: Arc<App>, startup: Startup, peer: Endpoint, _local: Endpoint) {
    let Startup { mut conn, user, .. } = startup;
    let admin = app.config.load().is_admin(&user);
    if !admin && !app.config.load().is_stats_user(&user) {
        app.errors
            .login_failed(crate::stats::LoginFailure::Authorization);
        conn.send_error(
            Severity::Fatal,
            sqlstate::INVALID_AUTHORIZATION,
            &format!(
                "user \"{user}\" is not an admin user of pgmemo (general.admin_users, \
                 stats_users)"
            ),
        )
        .await;
        return;
    }
    tracing::info!(%peer, %user, "admin console login");
    for (k, v) in [
        ("application_name", ""),
        ("client_encoding", "UTF8"),
        ("DateStyle", "ISO, MDY"),
        ("integer_datetimes", "on"),
        ("IntervalStyle", "postgres"),
        ("is_superuser", "on"),
        ("server_encoding", "UTF8"),
        (
            "server_version",
            concat!("15.0 (pgmemo ", env!("CARGO_PKG_VERSION"), ")"),
        ),
        ("session_authorization", user.as_str()),
        ("standard_conforming_strings", "on"),
        ("TimeZone", "UTC"),
    ] {
        be::parameter_status(&mut conn.wbuf, k, v);
    }
    be::backend_key_data(&mut conn.wbuf, 0, 0);
    be::ready_for_query(&mut conn.wbuf, b'I');
    if conn.flush().await.is_err() {
        return;
    }
    let mut failed_extended = false;
    let mut cutoff = app.cutoff_signal();
    loop {
        let read = tokio::select! {
            r = conn.read_message() => Some(r),
            // A shutdown closes console sessions last, with the clients cut off at its end.
            _ = cutoff.wait_for(|c| *c) => None,
        };
        let Some(read) = read else {
            conn.send_error(
                Severity::Fatal,
                sqlstate::ADMIN_SHUTDOWN,
                "terminating connection due to administrator command",
            )
            .await;
            return;
        };
        let Ok((tag, body)) = read else {
            return;
        };
        match tag {
            fe::QUERY => {
                let sql = fe::query_text(&body)
                    .map(String::from_utf8_lossy)
                    .unwrap_or_default();
                let reply = if let Some(reply) = fake_parameter(&sql) {
                    Ok(reply)
                } else if admin || is_read_only(&sql) {
                    run_command(&app, &sql).await
                } else {
                    // PgBouncer's answer to a stats user, ERROR 08P01.
                    Err((sqlstate::PROTOCOL_VIOLATION, "admin access needed".into()))
                };
                match reply {
                    Ok(Reply::Table(t)) => {
                        let n = t.rows.len();
                        be::row_description_text(&mut conn.wbuf, &t.columns);
                        for row in &t.rows {
                            be::data_row(&mut conn.wbuf, row);
                        }
                        be::command_complete(&mut conn.wbuf, &format!("SHOW {n}"));
                    }
                    Ok(Reply::Done(tag)) => be::command_complete(&mut conn.wbuf, &tag),
                    Ok(Reply::Noticed(notices, tag)) => {
                        for (code, message) in &notices {
                            be::notice_response(&mut conn.wbuf, code, message);
                        }
                        be::command_complete(&mut conn.wbuf, &tag);
                    }
                    Err((code, msg)) => {
                        be::error_response(&mut conn.wbuf, Severity::Error, code, &msg)
                    }
                }
                be::ready_for_query(&mut conn.wbuf, b'I');
            }
            fe::TERMINATE => return,
            fe::SYNC => {
                failed_extended = false;
                be::ready_for_query(&mut conn.wbuf, b'I');
            }
            _ if !failed_extended => {
                failed_extended = true;
                be::error_response(
                    &mut conn.wbuf,
                    Severity::Error,
                    sqlstate::FEATURE_NOT_SUPPORTED,
                    "the pgmemo admin console supports only the simple query protocol",
                );
            }
            _ => {}
        }
        if conn.flush().await.is_err() {
            return;
        }
    }
}

/// What a `stats_users` member may run: SHOW commands, but SHOW FDS (PgBouncer's rule: it
/// shows cancel keys).
fn is_read_only(sql: &str) -> bool {
    let mut words = sql.trim().trim_end_matches(';').split_whitespace();
    let first = words.next().unwrap_or_default();
    let second = words.next().unwrap_or_default();
    first.eq_ignore_ascii_case("show") && !second.eq_ignore_ascii_case("fds")
}

type CommandError = (&'static str, String);

/// The session parameters drivers set or read on connecting, which the console answers as
/// PgBouncer's does: `SHOW` gives these values, `SET` is ignored with a NOTICE (for stats
/// users too).
const FAKE_PARAMETERS: &[(&str, &str)] = &[
    ("client_encoding", "UTF-8"),
    ("default_transaction_isolation", "read committed"),
    ("standard_conforming_strings", "on"),
    ("datestyle", "ISO"),
    ("timezone", "GMT"),
];

fn fake_parameter(sql: &str) -> Option<Reply> {
    let fake = |name: &str| {
        FAKE_PARAMETERS
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
    };
    if let Some((key, _)) = parse_set(sql) {
        fake(&key)?;
        let notice = (sqlstate::SUCCESSFUL_COMPLETION, "SET ignored".to_owned());
        return Some(Reply::Noticed(vec![notice], "SET".into()));
    }
    let words: Vec<&str> = sql
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .collect();
    match words.as_slice() {
        [show, name] if show.eq_ignore_ascii_case("show") => {
            let (name, value) = fake(name)?;
            Some(Reply::Table(Table {
                columns: vec![name],
                rows: vec![vec![text(value)]],
            }))
        }
        _ => None,
    }
}

/// `SET key = value` / `SET key TO value` as PgBouncer's console reads it: the key a word or
/// a double-quoted name, the value a word or a single-quoted string (`''` inside it is a
/// quote); a `;` at the end may follow.
fn parse_set(sql: &str) -> Option<(String, String)> {
    let rest = sql.trim().trim_end_matches(';').trim_end();
    let (set, rest) = rest.split_at_checked(3)?;
    if !set.eq_ignore_ascii_case("set") || !rest.starts_with(char::is_whitespace) {
        return None;
    }
    let rest = rest.trim_start();
    let (key, rest) = match rest.strip_prefix('"') {
        Some(quoted) => {
            let end = quoted.find('"')?;
            (quoted[..end].to_owned(), &quoted[end + 1..])
        }
        None => {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
                .unwrap_or(rest.len());
            (rest[..end].to_ascii_lowercase(), &rest[end..])
        }
    };
    let rest = rest.trim_start();
    let rest = match rest.strip_prefix('=') {
        Some(r) => r,
        None => {
            let (to, r) = rest.split_at_checked(2)?;
            (to.eq_ignore_ascii_case("to") && r.starts_with(char::is_whitespace)).then_some(r)?
        }
    };
    let value = rest.trim();
    let value = match value.strip_prefix('\'') {
        Some(quoted) => quoted.strip_suffix('\'')?.replace("''", "'"),
        None if !value.is_empty() && !value.contains(char::is_whitespace) => value.to_owned(),
        None => return None,
    };
    (!key.is_empty()).then_some((key, value))
}

/// SET key = value: `[general]`'s setting changed in the running configuration, as
/// PgBouncer's console does (until the next RELOAD reads the file again). A setting that
/// needs a restart keeps its running value, with a NOTICE saying so.
fn set_setting(app: &App, key: &str, value: &str) -> Result<Reply, CommandError> {
    let failed = |e: String| (sqlstate::PROTOCOL_VIOLATION, format!("SET failed: {e}"));
    let (config, _) = app
        .config
        .load()
        .with_general_setting(key, value)
        .map_err(|e| failed(e.to_string()))?;
    let pending = app.reload(config).map_err(|e| failed(format!("{e:#}")))?;
    tracing::info!(key, value, "SET on the admin console");
    let notices = restart_notices(pending, false);
    Ok(Reply::Noticed(notices, format!("SET {key}={value}")))
}

/// Runs one console command.
pub async fn run_command(app: &Arc<App>, sql: &str) -> Result<Reply, CommandError> {
    if let Some((key, value)) = parse_set(sql) {
        return set_setting(app, &key, &value);
    }
    let words: Vec<String> = sql
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .map(|w| w.to_ascii_lowercase())
        .collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    match words.as_slice() {
        ["show", "pools"] => Ok(Reply::Table(show_pools(app))),
        ["show", "clients"] => Ok(Reply::Table(show_clients(app))),
        ["show", "servers"] => Ok(Reply::Table(show_servers(app))),
        ["show", "replicas"] => Ok(Reply::Table(show_replicas(app))),
        ["show", "stats"] => Ok(Reply::Table(show_stats(app))),
        ["show", "stats_totals"] => Ok(Reply::Table(show_stats_totals(app))),
        ["show", "stats_averages"] => Ok(Reply::Table(show_stats_averages(app))),
        ["show", "totals"] => Ok(Reply::Table(show_totals(app))),
        ["show", "mem"] => Ok(Reply::Table(show_mem(app))),
        ["show", "fds"] => Ok(Reply::Table(show_fds())),
        ["show", what @ ("peers" | "peer_pools" | "dns_hosts" | "dns_zones")] => {
            Ok(Reply::Table(show_nothing_to_list(what)))
        }
        ["show", "config"] => Ok(Reply::Table(show_config(app))),
        ["show", "databases"] => Ok(Reply::Table(show_databases(app))),
        ["show", "users"] => Ok(Reply::Table(show_users(app))),
        ["show", "lists"] => Ok(Reply::Table(show_lists(app))),
        ["show", "state"] => {
            // PgBouncer's: whether PAUSE (of everything) is in force; pgmemo has no SUSPEND.
            let paused = app.is_paused_all();
            let yes = |b: bool| text(if b { "yes" } else { "no" });
            Ok(Reply::Table(Table {
                columns: vec!["key", "value"],
                rows: vec![
                    vec![text("active"), yes(!paused)],
                    vec![text("paused"), yes(paused)],
                    vec![text("suspended"), yes(false)],
                ],
            }))
        }
        ["show", "prepared_statements"] => Ok(Reply::Table(show_prepared_statements(app))),
        ["show", "autoprepare"] => Ok(Reply::Table(show_autoprepare(app))),
        ["show", "queries"] => Ok(Reply::Table(show_queries(app))),
        ["show", "autoprepare_reasons"] => Ok(Reply::Table(show_autoprepare_reasons(app))),
        ["show", "cache"] => Ok(Reply::Table(show_cache(app))),
        ["show", "cache", "entries"] | ["show", "cache_entries"] => {
            Ok(Reply::Table(show_cache_entries(app)))
        }
        ["show", "cache_bypasses"] => Ok(Reply::Table(show_cache_bypasses(app))),
        ["show", "cache", "wal"] | ["show", "cache_wal"] => Ok(Reply::Table(show_cache_wal(app))),
        ["show", "cache", "rows"] | ["show", "cache_rows"] => {
            Ok(Reply::Table(show_cache_rows(app)))
        }
        ["show", "cache", "shared"] | ["show", "cache_shared"] => {
            Ok(Reply::Table(show_cache_shared(app)))
        }
        ["cache", "flush"] | ["cache", "flush", "all"] => {
            app.cache.flush(crate::cache::FlushTarget::All);
            Ok(Reply::Done("CACHE FLUSH".into()))
        }
        ["cache", "flush", "database", db] => {
            for id in server_databases(app, Some(db)) {
                app.cache.flush(crate::cache::FlushTarget::Database(&id));
            }
            Ok(Reply::Done("CACHE FLUSH".into()))
        }
        ["cache", "flush", "table", table] | ["cache", "flush", "table", table, _] => {
            for db in &server_databases(app, words.get(4).copied()) {
                app.cache.flush(crate::cache::FlushTarget::Table(db, table));
            }
            Ok(Reply::Done("CACHE FLUSH".into()))
        }
        ["show", "version"] => Ok(Reply::Table(Table {
            columns: vec!["version"],
            rows: vec![vec![Some(format!("pgmemo {}", env!("CARGO_PKG_VERSION")))]],
        })),
        ["show", "help"] | ["help"] => Ok(Reply::Table(Table {
            columns: vec!["command"],
            rows: [
                "SHOW POOLS|CLIENTS|SERVERS|STATS|CONFIG|VERSION|PREPARED_STATEMENTS",
                "SHOW DATABASES|USERS|LISTS|STATE|REPLICAS",
                "SHOW STATS_TOTALS|STATS_AVERAGES|TOTALS|MEM|FDS",
                "SHOW PEERS|PEER_POOLS|DNS_HOSTS|DNS_ZONES",
                "SHOW AUTOPREPARE|AUTOPREPARE_REASONS|QUERIES",
                "SHOW CACHE|CACHE ENTRIES|CACHE_BYPASSES|CACHE WAL|CACHE ROWS|CACHE SHARED",
                "CACHE FLUSH [ALL | DATABASE db | TABLE name [db]]",
                "RELOAD",
                "SET key = arg",
                "PAUSE [db]",
                "RESUME [db]",
                "RECONNECT [db]",
                "WAIT_CLOSE [db]",
                "KILL [db]",
                "DISABLE db",
                "ENABLE db",
                "KILL_CLIENT id",
                "SHUTDOWN [WAIT_FOR_SERVERS | WAIT_FOR_CLIENTS]",
            ]
            .iter()
            .map(|s| vec![Some(s.to_string())])
            .collect(),
        })),
        ["reload"] => reload(app),
        ["pause"] | ["pause", _] => {
            let pools = app.pause_databases(words.get(1).copied());
            // As PgBouncer's PAUSE: the caller knows no query is running when it returns.
            until_none(&pools, |p| p.counts().1 > 0).await;
            Ok(Reply::Done("PAUSE".into()))
        }
        ["resume"] | ["resume", _] => {
            app.resume_databases(words.get(1).copied())
                .map_err(|e| (sqlstate::PROTOCOL_VIOLATION, e.to_string()))?;
            Ok(Reply::Done("RESUME".into()))
        }
        ["reconnect"] | ["reconnect", _] => {
            for pool in app.pools_of(words.get(1).copied()) {
                pool.reconnect().await;
            }
            Ok(Reply::Done("RECONNECT".into()))
        }
        ["disable"] | ["enable"] => Err((
            sqlstate::PROTOCOL_VIOLATION,
            "a database is required".into(),
        )),
        [verb @ ("disable" | "enable"), db] => {
            if crate::config::is_admin_database(db) {
                return Err((
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("cannot disable admin db: {db}"),
                ));
            }
            if app.config.load().resolve(db, "").is_none() {
                return Err((
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("no such database: {db}"),
                ));
            }
            app.set_disabled(db, *verb == "disable");
            Ok(Reply::Done(verb.to_ascii_uppercase()))
        }
        ["wait_close"] | ["wait_close", _] => {
            until_none(&app.pools_of(words.get(1).copied()), |p| p.retiring() > 0).await;
            Ok(Reply::Done("WAIT_CLOSE".into()))
        }
        ["kill"] | ["kill", _] => {
            let db = words.get(1).copied();
            let pools = app.pause_databases(db);
            for client in app.clients() {
                if db.is_none_or(|db| client.database.eq_ignore_ascii_case(db)) {
                    client.kill();
                }
            }
            for pool in &pools {
                pool.reconnect().await;
            }
            Ok(Reply::Done("KILL".into()))
        }
        ["kill_client", id] => {
            let client = id
                .parse::<u64>()
                .ok()
                .and_then(|id| app.clients().into_iter().find(|c| c.id == id));
            let Some(client) = client else {
                return Err((sqlstate::PROTOCOL_VIOLATION, "client not found".into()));
            };
            client.kill();
            Ok(Reply::Done("KILL_CLIENT".into()))
        }
        // PgBouncer's three: at once; once the running transactions have finished (SIGINT);
        // once every client has gone, serving them meanwhile (SIGTERM).
        ["shutdown"] => {
            app.begin_shutdown();
            app.cut_off();
            Ok(Reply::Done("SHUTDOWN".into()))
        }
        ["shutdown", "wait_for_servers"] => {
            app.begin_shutdown();
            Ok(Reply::Done("SHUTDOWN".into()))
        }
        ["shutdown", "wait_for_clients"] => {
            app.begin_drain();
            Ok(Reply::Done("SHUTDOWN".into()))
        }
        _ => Err((
            sqlstate::SYNTAX_ERROR,
            format!("invalid command '{}', use SHOW HELP;", sql.trim()),
        )),
    }
}

/// RELOAD: the new configuration applied, a NOTICE for each changed setting that waits for a
/// restart; or, when the file cannot be used, an error saying where, the old configuration
/// kept (SQLSTATE F0000, as PgBouncer's "RELOAD failed").
fn reload(app: &Arc<App>) -> Result<Reply, CommandError> {
    tracing::info!("RELOAD command issued");
    let pending = crate::reload(app).map_err(|e| {
        tracing::error!("RELOAD failed, keeping the old configuration: {e:#}");
        (
            sqlstate::CONFIG_FILE_ERROR,
            format!("RELOAD failed, keeping the old configuration: {e:#}"),
        )
    })?;
    Ok(Reply::Noticed(
        restart_notices(pending, true),
        "RELOAD".into(),
    ))
}

/// A NOTICE for each changed setting that keeps its running value until a restart (RELOAD,
/// SET); with `from_file`, the file's value too.
fn restart_notices(
    pending: Vec<crate::config::PendingRestart>,
    from_file: bool,
) -> Vec<(&'static str, String)> {
    let notice = |p: crate::config::PendingRestart| {
        let mut message = format!(
            "parameter \"{}\" cannot be changed without restarting pgmemo: keeping {:?}",
            p.key, p.running
        );
        if from_file {
            message.push_str(&format!(" (the file says {:?})", p.pending));
        }
        (sqlstate::CANT_CHANGE_RUNTIME_PARAM, message)
    };
    pending.into_iter().map(notice).collect()
}

/// Returns once `busy` holds for none of `pools`, looking every 20 ms (PAUSE, WAIT_CLOSE).
async fn until_none(pools: &[Arc<crate::pool::Pool>], busy: impl Fn(&crate::pool::Pool) -> bool) {
    let mut tick = crate::timer::interval(Duration::from_millis(20));
    while pools.iter().any(|p| busy(p)) {
        tick.tick().await;
    }
}

fn text(v: impl ToString) -> Option<String> {
    Some(v.to_string())
}

fn timestamp(t: SystemTime) -> Option<String> {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Some(format_unix(secs))
}

/// `YYYY-MM-DD HH:MM:SS UTC` without a date library (days-from-civil inverse).
fn format_unix(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// PgBouncer's SHOW POOLS, a row per (database, user) pool, then pgmemo's pin counts.
///
/// - `cl_active_cancel_req`: clients whose cancel request is being passed on to their server.
/// - `cl_waiting_cancel_req`, `sv_active_cancel`, `sv_being_canceled`: always 0. pgmemo
///   passes a cancel request on at once on a connection of its own, which is no pool server
///   and waits in no queue (see cancel.rs), and a cancelled server waits for nothing more
///   before it is given back.
/// - `load_balance_hosts`: NULL, as PgBouncer's for a database with one host (pgmemo's have
///   one).
pub fn show_pools(app: &App) -> Table {
    let clients = app.clients();
    let now = app.clock_us();
    let rows = app
        .pools()
        .iter()
        .map(|pool| {
            let mine = clients
                .iter()
                .filter(|c| *c.database == *pool.key.database && *c.user == *pool.key.user);
            let (mut active, mut waiting, mut pinned, mut cancelling) = (0, 0, 0, 0);
            // PgBouncer's maxwait: how long the oldest waiting client has waited, from its
            // query's start, or from its wait's at login (`ClientInfo::query_age_us`).
            let mut max_wait = 0;
            for c in mine {
                if c.pins.load(Relaxed) != 0 {
                    pinned += 1;
                }
                if c.cancels.pending() {
                    cancelling += 1;
                }
                match c.state() {
                    ClientState::Waiting => {
                        waiting += 1;
                        max_wait = max_wait.max(c.query_age_us(now).unwrap_or(0));
                    }
                    _ => active += 1,
                }
            }
            let servers = pool.servers();
            let count = |s: ServerState| servers.iter().filter(|i| i.state() == s).count();
            vec![
                text(&pool.key.database),
                text(&pool.key.user),
                text(active),
                text(waiting),
                text(cancelling),
                text(0),
                text(count(ServerState::Active)),
                text(0),
                text(0),
                text(count(ServerState::Idle)),
                text(count(ServerState::Used)),
                text(count(ServerState::Tested)),
                text(count(ServerState::Login)),
                text(max_wait / 1_000_000),
                text(max_wait % 1_000_000),
                text(pool.settings().mode.as_str()),
                None,
                text(pinned),
                text(pool.pinned_servers()),
            ]
        })
        .collect();
    Table {
        columns: vec![
            "database",
            "user",
            "cl_active",
            "cl_waiting",
            "cl_active_cancel_req",
            "cl_waiting_cancel_req",
            "sv_active",
            "sv_active_cancel",
            "sv_being_canceled",
            "sv_idle",
            "sv_used",
            "sv_tested",
            "sv_login",
            "maxwait",
            "maxwait_us",
            "pool_mode",
            "load_balance_hosts",
            // pgmemo's: clients that keep their server for session state.
            "cl_pinned",
            // pgmemo's: servers those clients hold, at most max_pinned_fraction of pool_size.
            "sv_pinned",
        ],
        rows,
    }
}

/// PgBouncer 1.25's columns of SHOW CLIENTS and SHOW SERVERS, in its order; pgmemo's own
/// follow them.
const CONN_COLUMNS: [&str; 21] = [
    "type",
    "user",
    "database",
    "replication",
    "state",
    "addr",
    "port",
    "local_addr",
    "local_port",
    "connect_time",
    "request_time",
    "wait",
    "wait_us",
    "close_needed",
    "ptr",
    "link",
    "remote_pid",
    "tls",
    "application_name",
    "prepared_statements",
    "id",
];

/// A client's state as PgBouncer 1.25's SHOW CLIENTS names it: a logged-in client that is
/// not waiting for a server is "active" when it holds one (`link`), "idle" when it does not.
fn client_state(state: ClientState) -> &'static str {
    match state {
        ClientState::Login => "login",
        ClientState::Waiting => "waiting",
        ClientState::Idle => "idle",
        ClientState::Active => "active",
    }
}

/// PgBouncer's SHOW CLIENTS, then pgmemo's `pinned` (why the client keeps its server: temp,
/// listen, advisory_lock, cursor, load).
///
/// - `request_time`: when the client last sent something (to the wake of its session that
///   read it).
/// - `wait`, `wait_us`: as PgBouncer computes them, the age of the client's query in flight
///   (from its first message that needs a server until the ReadyForQuery that answers its
///   work), waiting for a server included; at login, how long the client has waited for a
///   server (a session's own, or one its parameters are settled on); 0 otherwise.
/// - `replication`: `none`, or `logical` / `physical` for a replication connection (relayed
///   to a server of its own).
/// - `close_needed`: 0, unused for clients as in PgBouncer.
/// - `ptr` and `id`: the client's id (pgmemo has no object addresses), which KILL_CLIENT
///   takes; `link` is the id of the server it holds.
/// - `prepared_statements`: 0. A client's statements live in its session, which the console
///   does not reach; SHOW PREPARED_STATEMENTS counts the clients that hold each statement.
pub fn show_clients(app: &App) -> Table {
    let now = app.clock_us();
    let rows = app
        .clients()
        .iter()
        .map(|c| {
            let server = c.server_id.load(std::sync::atomic::Ordering::Relaxed);
            let wait = c.query_age_us(now).unwrap_or(0);
            vec![
                text("C"),
                text(&c.user),
                text(&c.database),
                text(c.replication().name()),
                text(client_state(c.state())),
                text(c.addr.host()),
                text(c.addr.port()),
                text(c.local_addr.host()),
                text(c.local_addr.port()),
                timestamp(c.connect_time()),
                timestamp(c.request_time()),
                text(wait / 1_000_000),
                text(wait % 1_000_000),
                text(0),
                text(c.id),
                (server != 0).then(|| server.to_string()),
                text(c.pid()),
                text(if c.tls() { "TLS" } else { "" }),
                text(c.application_name.lock().to_string()),
                text(0),
                text(c.id),
                text(crate::pins::Pins::describe(c.pins.load(Relaxed))),
            ]
        })
        .collect();
    let mut columns = CONN_COLUMNS.to_vec();
    columns.push("pinned");
    Table { columns, rows }
}

/// PgBouncer's SHOW SERVERS, then pgmemo's prepared-statement counters per server, then its
/// role: `primary`, or `replica` for a server of a replica's pool (see [`show_replicas`]).
///
/// - `request_time`: when the server was last handed to a client or given back.
/// - `wait`, `wait_us`: 0, unused for servers as in PgBouncer.
/// - `replication`: `logical` / `physical` for a replication client's own server, else `none`
///   (the WAL follower's connections are pgmemo's own, see SHOW CACHE WAL).
/// - `ptr` and `id`: the server's id; `link`: the id of the client holding it.
/// - `application_name`: the linked client's, as in PgBouncer.
pub fn show_servers(app: &App) -> Table {
    let names: std::collections::HashMap<u64, String> = app
        .clients()
        .iter()
        .map(|c| (c.id, c.application_name.lock().to_string()))
        .collect();
    let mut rows = Vec::new();
    let replicas = app.replica_sets().into_iter().flat_map(|set| {
        set.members()
            .iter()
            .map(|r| r.pool.clone())
            .collect::<Vec<_>>()
    });
    let pools = app
        .pools()
        .into_iter()
        .map(|p| (p, "primary"))
        .chain(replicas.map(|p| (p, "replica")));
    for (pool, role) in pools {
        let mut servers = pool.servers();
        servers.sort_by_key(|s| s.id);
        for s in servers {
            let client = s.client_id.load(std::sync::atomic::Ordering::Relaxed);
            rows.push(vec![
                text("S"),
                text(&pool.key.user),
                text(&pool.key.database),
                text(s.replication.name()),
                text(s.state().name()),
                // A server behind a Unix socket: addr "unix" and the server's port, as
                // PgBouncer shows it.
                match &s.unix_socket {
                    Some(_) => text("unix"),
                    None => text(s.addr.ip()),
                },
                match &s.unix_socket {
                    Some(path) => text(crate::server::socket_port(path).unwrap_or(0)),
                    None => text(s.addr.port()),
                },
                match &s.unix_socket {
                    Some(_) => text("unix"),
                    None => text(s.local_addr.ip()),
                },
                text(s.local_addr.port()),
                timestamp(s.connect_time),
                timestamp(s.request_time()),
                text(0),
                text(0),
                text(u8::from(pool.is_retired(&s))),
                text(s.id),
                (client != 0).then(|| client.to_string()),
                text(s.backend_pid),
                text(if s.tls { "TLS" } else { "" }),
                text(names.get(&client).map_or("", String::as_str)),
                text(s.prepared_statements.load(Relaxed)),
                text(s.id),
                text(s.prepare_cache_hit.load(Relaxed)),
                text(s.prepare_cache_miss.load(Relaxed)),
                text(s.prepare_evictions.load(Relaxed)),
                text(role),
            ]);
        }
    }
    let mut columns = CONN_COLUMNS.to_vec();
    columns.extend([
        "prepare_cache_hit",
        "prepare_cache_miss",
        "prepare_evictions",
        "role",
    ]);
    Table { columns, rows }
}

/// pgmemo's own: each replica of each pool that has some (see docs/replicas.md).
///
/// - `state`: `up` (reached, a standby, its position read), or `down`.
/// - `replay_lsn`: its replay position as last read (empty: not known).
/// - `lag_bytes`, `lag_ms`: WAL the primary wrote that it has not replayed, and how long
///   ago the primary passed its position (empty: not known).
/// - `reads`: units of work sent to it.
/// - `sv_active`, `sv_idle`: its pool's servers in use and idle.
pub fn show_replicas(app: &App) -> Table {
    let mut rows = Vec::new();
    for set in app.replica_sets() {
        for r in set.members().iter() {
            let (idle, active, _) = r.pool.counts();
            let lag = r.lag();
            let replayed = r.replayed();
            rows.push(vec![
                text(&set.key.database),
                text(&set.key.user),
                text(&r.host),
                text(r.port),
                text(if r.is_up() { "up" } else { "down" }),
                (replayed != 0).then(|| crate::lsn::format(replayed)),
                lag.map(|(bytes, _)| bytes.to_string()),
                lag.map(|(_, us)| (us / 1000).to_string()),
                text(r.reads.load(Relaxed)),
                text(active),
                text(idle),
            ]);
        }
    }
    Table {
        columns: vec![
            "database",
            "user",
            "host",
            "port",
            "state",
            "replay_lsn",
            "lag_bytes",
            "lag_ms",
            "reads",
            "sv_active",
            "sv_idle",
        ],
        rows,
    }
}

/// Every statement in the registry: what it is, who holds it, how it is used.
pub fn show_prepared_statements(app: &App) -> Table {
    use std::hash::{Hash, Hasher};
    let rows = app
        .registry
        .all()
        .iter()
        .map(|s| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            s.key.hash(&mut h);
            let types = s
                .param_oids()
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",");
            vec![
                text(format!("{:016x}", h.finish())),
                text(&*s.server_name),
                text(s.query_text()),
                text(types),
                text(s.holders.load(Relaxed)),
                text(s.servers.load(Relaxed)),
                text(s.parse_hits.load(Relaxed)),
                text(s.server_prepares.load(Relaxed)),
                text(s.evictions.load(Relaxed)),
                text(s.generation()),
            ]
        })
        .collect();
    Table {
        columns: vec![
            "hash",
            "name",
            "query",
            "parameter_types",
            "clients",
            "servers",
            "parse_hits",
            "server_prepares",
            "evictions",
            "generation",
        ],
        rows,
    }
}

/// Per database: its pools' counters summed, and their averages over the current stats
/// periods (PgBouncer's SHOW STATS groups its pools by database the same way).
fn database_stats(app: &App) -> Vec<(String, StatsSnapshot, Averages)> {
    use std::collections::BTreeMap;
    let mut per_db: BTreeMap<String, (StatsSnapshot, Averages)> = BTreeMap::new();
    let now = std::time::Instant::now();
    for pool in app.pools() {
        let s = pool.stats.snapshot();
        let (since, then) = pool.stats_periods.since();
        let e = per_db.entry(pool.key.database.clone()).or_default();
        e.1.add(&s, &then, now.saturating_duration_since(since));
        e.0.add(&s);
    }
    per_db.into_iter().map(|(db, (s, a))| (db, s, a)).collect()
}

/// PgBouncer's eleven figures, totals (SHOW STATS_TOTALS' order): server assignments,
/// transactions, queries, bytes received and sent, transaction, query and wait time (µs),
/// client Parses, server Parses, Binds.
fn totals_of(s: &StatsSnapshot) -> [u64; 11] {
    [
        s.server_assignments,
        s.xact_count,
        s.query_count,
        s.bytes_received,
        s.bytes_sent,
        s.xact_time_us,
        s.query_time_us,
        s.wait_time_us,
        s.client_parses,
        s.prepare_cache_miss,
        s.binds,
    ]
}

/// The same figures as averages, as PgBouncer computes them: counts and bytes per second,
/// transaction and query time per transaction and query, wait time per server assignment.
fn averages_of(a: &Averages) -> [u64; 11] {
    let per = |total: u64, n: u64| total.checked_div(n).unwrap_or(0);
    let d = &a.delta;
    let mut figures = a.rates.map(|r| r as u64);
    figures[5] = per(d.xact_time_us, d.xact_count);
    figures[6] = per(d.query_time_us, d.query_count);
    figures[7] = per(d.wait_time_us, d.server_assignments);
    figures
}

const TOTAL_NAMES: [&str; 11] = [
    "server_assignment_count",
    "xact_count",
    "query_count",
    "received",
    "sent",
    "xact_time",
    "query_time",
    "wait_time",
    "client_parse_count",
    "server_parse_count",
    "bind_count",
];

/// PgBouncer's SHOW STATS (per database: `total_*` since start, `avg_*` over the last
/// stats_period or two), then pgmemo's own counters.
///
/// - `total_query_time`: from a client's first message that needs a server to the
///   ReadyForQuery that answers its work, waiting for a server included, summed (as
///   PgBouncer's `query_start`); pipelined queries count once, as in PgBouncer. Queries the
///   result cache answers take no server time.
/// - `total_wait_time`: each wait for a server (a transaction's, and a login's), from its
///   start until the server is handed over (the connect of one opened for it included),
///   added when it ends with a server, as PgBouncer's.
/// - `total_server_parse_count`: statements parsed on a server (`prepare_cache_miss`);
///   `total_client_parse_count` and `total_bind_count`: Parse and Bind messages of named
///   statements, counted when pgmemo tracks them (`max_prepared_statements` > 0).
pub fn show_stats(app: &App) -> Table {
    let rows = database_stats(app)
        .into_iter()
        .map(|(db, s, a)| {
            let mut row = vec![text(db)];
            row.extend(totals_of(&s).into_iter().map(text));
            row.extend(averages_of(&a).into_iter().map(text));
            row.extend(
                [
                    s.prepare_cache_hit,
                    s.prepare_cache_miss,
                    s.prepare_evictions,
                    s.autoprepared,
                    s.autoprepare_passed,
                    s.state_probes,
                    s.pins.iter().sum::<u64>(),
                    s.serverless_batches,
                    s.server_moves,
                    s.client_moves,
                ]
                .into_iter()
                .map(text),
            );
            row
        })
        .collect();
    let mut columns = vec!["database"];
    columns.extend([
        "total_server_assignment_count",
        "total_xact_count",
        "total_query_count",
        "total_received",
        "total_sent",
        "total_xact_time",
        "total_query_time",
        "total_wait_time",
        "total_client_parse_count",
        "total_server_parse_count",
        "total_bind_count",
        "avg_server_assignment_count",
        "avg_xact_count",
        "avg_query_count",
        "avg_recv",
        "avg_sent",
        "avg_xact_time",
        "avg_query_time",
        "avg_wait_time",
        "avg_client_parse_count",
        "avg_server_parse_count",
        "avg_bind_count",
    ]);
    columns.extend([
        "prepare_cache_hit",
        "prepare_cache_miss",
        "prepare_evictions",
        "autoprepared",
        "autoprepare_passed",
        "state_probes",
        "pins",
        "serverless_batches",
        "server_moves",
        "client_moves",
    ]);
    Table { columns, rows }
}

/// PgBouncer's SHOW STATS_TOTALS: SHOW STATS' totals, named without `total_` (and
/// `bytes_received`, `bytes_sent`), as pgbouncer_exporter reads them.
pub fn show_stats_totals(app: &App) -> Table {
    stats_subset(
        app,
        |s, _| totals_of(s),
        |i| match i {
            3 => "bytes_received",
            4 => "bytes_sent",
            _ => TOTAL_NAMES[i],
        },
    )
}

/// PgBouncer's SHOW STATS_AVERAGES: SHOW STATS' averages, under PgBouncer's names for them
/// (the prepared-statement ones keep their `avg_`).
pub fn show_stats_averages(app: &App) -> Table {
    stats_subset(
        app,
        |_, a| averages_of(a),
        |i| match i {
            3 => "bytes_received",
            4 => "bytes_sent",
            8 => "avg_client_parse_count",
            9 => "avg_server_parse_count",
            10 => "avg_bind_count",
            _ => TOTAL_NAMES[i],
        },
    )
}

/// A row per database of the eleven `figures`, under the columns `name` gives.
fn stats_subset(
    app: &App,
    figures: fn(&StatsSnapshot, &Averages) -> [u64; 11],
    name: impl Fn(usize) -> &'static str,
) -> Table {
    let rows = database_stats(app)
        .into_iter()
        .map(|(db, s, a)| {
            let mut row = vec![text(db)];
            row.extend(figures(&s, &a).into_iter().map(text));
            row
        })
        .collect();
    let mut columns = vec!["database"];
    columns.extend((0..11).map(name));
    Table { columns, rows }
}

/// PgBouncer's SHOW TOTALS: SHOW STATS over every database, a row per figure. The names are
/// PgBouncer's own (`total_client_bytes` for received, `total_ps_bind_count`, ...).
pub fn show_totals(app: &App) -> Table {
    let mut all = StatsSnapshot::default();
    let mut avg = Averages::default();
    for (_, s, a) in database_stats(app) {
        all.add(&s);
        avg.merge(&a);
    }
    const NAMES: [&str; 11] = [
        "server_assignment_count",
        "xact_count",
        "query_count",
        "client_bytes",
        "server_bytes",
        "xact_time",
        "query_time",
        "wait_time",
        "ps_client_parse_count",
        "ps_server_parse_count",
        "ps_bind_count",
    ];
    let totals = NAMES
        .iter()
        .zip(totals_of(&all))
        .map(|(n, v)| ("total", n, v));
    let averages = NAMES
        .iter()
        .zip(averages_of(&avg))
        .map(|(n, v)| ("avg", n, v));
    let rows = totals
        .chain(averages)
        .map(|(kind, n, v)| vec![text(format!("{kind}_{n}")), text(v)])
        .collect();
    Table {
        columns: vec!["name", "value"],
        rows,
    }
}

/// A database's counters over its pools' current stats periods: what changed, and the
/// per-second rates of the eleven figures ([`totals_of`]'s order), summed over its pools
/// (each over its own period: a pool made a moment ago is not diluted by a full one).
#[derive(Default)]
struct Averages {
    delta: StatsSnapshot,
    rates: [f64; 11],
}

impl Averages {
    /// Adds a pool whose totals are `now` and were `then`, `elapsed` ago.
    fn add(&mut self, now: &StatsSnapshot, then: &StatsSnapshot, elapsed: Duration) {
        let secs = elapsed.as_secs_f64().max(0.001);
        let (now, then) = (totals_of(now), totals_of(then));
        let mut delta = [0; 11];
        for i in 0..11 {
            delta[i] = now[i].saturating_sub(then[i]);
            self.rates[i] += delta[i] as f64 / secs;
        }
        self.delta.add(&StatsSnapshot {
            server_assignments: delta[0],
            xact_count: delta[1],
            query_count: delta[2],
            xact_time_us: delta[5],
            query_time_us: delta[6],
            wait_time_us: delta[7],
            ..StatsSnapshot::default()
        });
    }

    fn merge(&mut self, o: &Averages) {
        self.delta.add(&o.delta);
        for (r, o) in self.rates.iter_mut().zip(o.rates) {
            *r += o;
        }
    }
}

/// Every remembered query shape: its generalized text, how often it was seen and run
/// prepared, and why it is not generalized when it is not.
pub fn show_autoprepare(app: &App) -> Table {
    let rows = app
        .autoprepare
        .shapes()
        .iter()
        .map(|s| {
            let seen = s.seen.load(Relaxed);
            let executions = s.executions.load(Relaxed);
            vec![
                text(format!("{:016x}", s.query_hash)),
                text(s.text()),
                s.parameters().map(|n| n.to_string()),
                text(seen),
                text(executions),
                text(seen.saturating_sub(executions)),
                text(crate::autoprepare::never(s).map_or("", |p| p.as_str())),
            ]
        })
        .collect();
    Table {
        columns: vec![
            "hash",
            "query",
            "parameters",
            "uses",
            "prepared_executions",
            "passed_through",
            "never_because",
        ],
        rows,
    }
}

/// One row of SHOW QUERIES: the shapes of one `query_hash` (a simple query's and a prepared
/// statement's of the same text, or simple queries of one text with literals of other
/// kinds, which autoprepare tells apart) and their figures, added up.
pub struct QueryFigures {
    /// The shape that speaks for the row: a simple query's, when one has the hash.
    pub shape: Arc<crate::query::shapes::Shape>,
    pub query_hash: u64,
    pub calls: u64,
    /// Estimated time on the server (each shape's measured mean times its calls that ran
    /// there).
    pub total_us: f64,
    /// Calls timed on the server, and their time in microseconds.
    pub timed: u64,
    pub timed_us: u64,
    /// Estimated rows (returned or written): each shape's measured mean times all its calls.
    pub rows: f64,
    pub hits: u64,
    pub misses: u64,
    /// Simple queries of the row run as autoprepared statements.
    pub executions: u64,
    /// Which protocols sent its queries: `simple`, `extended` or `both`.
    pub protocol: &'static str,
    /// What last chose it for the cache, and why the cache last passed it by (see
    /// `ShapeStats::chosen`, `ShapeStats::bypass`): the first shape's that has one.
    pub chosen: u16,
    pub bypass: u16,
    /// Auto mode's word on it.
    pub auto: Option<&'static str>,
}

impl QueryFigures {
    fn of(shape: Arc<crate::query::shapes::Shape>) -> QueryFigures {
        let s = &shape.stats;
        let (hits, misses) = s.cache.get().map_or((0, 0), |c| {
            (c.hits.get() + c.raw_hits.get(), c.misses.get())
        });
        QueryFigures {
            query_hash: shape.query_hash,
            calls: s.all_calls(),
            total_us: s.total_us(),
            timed: s.timed.load(Relaxed),
            timed_us: s.timed_us.load(Relaxed),
            rows: s.total_rows(),
            hits,
            misses,
            executions: shape.executions.load(Relaxed),
            protocol: if shape.is_extended() {
                "extended"
            } else {
                "simple"
            },
            chosen: s.chosen.load(Relaxed),
            bypass: s.bypass.load(Relaxed),
            auto: crate::cache::auto::state(&shape),
            shape,
        }
    }

    /// Adds `o`, another shape of the same `query_hash`.
    fn add(&mut self, o: QueryFigures) {
        self.calls += o.calls;
        self.total_us += o.total_us;
        self.timed += o.timed;
        self.timed_us += o.timed_us;
        self.rows += o.rows;
        self.hits += o.hits;
        self.misses += o.misses;
        self.executions += o.executions;
        if self.protocol != o.protocol {
            self.protocol = "both";
        }
        self.chosen = if self.chosen == 0 {
            o.chosen
        } else {
            self.chosen
        };
        self.bypass = if self.bypass == 0 {
            o.bypass
        } else {
            self.bypass
        };
        self.auto = self.auto.or(o.auto);
        if self.shape.is_extended() && !o.shape.is_extended() {
            self.shape = o.shape;
        }
    }

    /// The mean time on the server, in microseconds (None: never measured).
    pub fn mean_us(&self) -> Option<f64> {
        (self.timed > 0).then(|| self.timed_us as f64 / self.timed as f64)
    }
}

/// The shapes of simple queries and prepared statements, a row per `query_hash`, by their
/// estimated total time on the server, most first (then by calls): what is worth caching.
pub fn query_figures(app: &App) -> Vec<QueryFigures> {
    let mut by_hash: std::collections::HashMap<u64, QueryFigures> = Default::default();
    for shape in app.shapes.iter() {
        let q = QueryFigures::of(shape);
        match by_hash.entry(q.query_hash) {
            std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().add(q),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(q);
            }
        }
    }
    let mut rows: Vec<QueryFigures> = by_hash.into_values().collect();
    rows.sort_by(|a, b| {
        b.total_us
            .total_cmp(&a.total_us)
            .then(b.calls.cmp(&a.calls))
            .then(a.query_hash.cmp(&b.query_hash))
    });
    rows
}

/// Per query (a `query_hash`: the normalized text, whichever protocol sent it): how often it
/// runs and how long the server takes (SHOW STATS' figures for one query), the tables it
/// reads, whether the result cache may keep it and why not, what chose it, the cache's hits
/// and misses, and autoprepare's use of it. `query_hash` is what SHOW AUTOPREPARE prints and
/// a rule's `query_hash` matches.
pub fn show_queries(app: &App) -> Table {
    let rules = app.cache.rule_stats();
    let reasons = crate::query::analysis::BYPASS_REASONS;
    let rows = query_figures(app)
        .into_iter()
        .map(|q| {
            let s = &q.shape;
            let analysis = s.analysis();
            let tables = analysis.and_then(|a| a.read.as_ref().ok()).map(|r| {
                let names: Vec<String> = r
                    .relations
                    .iter()
                    .map(|t| match &t.schema {
                        Some(schema) => format!("{schema}.{}", t.name),
                        None => t.name.to_string(),
                    })
                    .collect();
                names.join(",")
            });
            let cacheable = analysis.map(|a| match &a.read {
                Ok(_) => "yes".to_string(),
                Err(why) => why.as_str().to_string(),
            });
            let chosen = match q.chosen {
                0 => None,
                n => rules.get(n as usize - 1).map(|r| r.name.clone()),
            };
            let bypass = match q.bypass {
                0 => None,
                n => reasons.get(n as usize - 1).map(|r| r.as_str().to_string()),
            };
            let ratio = if q.hits + q.misses == 0 {
                None
            } else {
                Some(format!("{:.3}", q.hits as f64 / (q.hits + q.misses) as f64))
            };
            let never = if s.is_extended() {
                Some(EXTENDED_NEVER.to_string())
            } else {
                crate::autoprepare::never(s).map(|p| p.as_str().to_string())
            };
            vec![
                text(format!("{:016x}", q.query_hash)),
                text(s.text()),
                text(q.calls),
                text(format!("{:.3}", q.total_us / 1000.0)),
                q.mean_us().map(|m| format!("{m:.1}")),
                text(q.timed),
                text(format!("{:.0}", q.rows)),
                tables,
                cacheable,
                chosen,
                bypass,
                text(q.hits),
                text(q.misses),
                ratio,
                text(q.executions),
                never,
                q.auto.map(str::to_string),
                text(q.protocol),
            ]
        })
        .collect();
    Table {
        columns: vec![
            "query_hash",
            "query",
            "calls",
            "total_server_ms",
            "mean_server_us",
            "timed",
            "rows",
            "tables",
            "cacheable",
            "chosen_by",
            "last_bypass",
            "cache_hits",
            "cache_misses",
            "hit_ratio",
            "autoprepared",
            "autoprepare_never",
            "auto",
            "protocol",
        ],
        rows,
    }
}

/// SHOW QUERIES' `autoprepare_never` of a query only prepared statements sent.
const EXTENDED_NEVER: &str = "prepared by the client (extended protocol)";

/// The result cache per rule (the last row: queries chosen by a hint).
pub fn show_cache(app: &App) -> Table {
    let usage = app.cache.usage();
    let (memory, limit) = app.cache.memory();
    let rows = app
        .cache
        .rule_stats()
        .iter()
        .map(|r| {
            let (entries, bytes) = usage.get(&r.name).copied().unwrap_or_default();
            let hits = r.hits.get();
            let misses = r.misses.get();
            let ratio = if hits + misses == 0 {
                0.0
            } else {
                hits as f64 / (hits + misses) as f64
            };
            vec![
                text(&r.name),
                text(entries),
                text(bytes),
                text(hits),
                text(misses),
                text(format!("{ratio:.3}")),
                text(r.stores.load(Relaxed)),
                text(r.evictions.load(Relaxed)),
                text(r.invalidations.load(Relaxed)),
                text(r.bypasses.get()),
                text(r.refreshes.load(Relaxed)),
                text(memory),
                text(limit),
                text(app.cache.versions.row_versions()),
                text(app.cache.versions.row_bytes()),
            ]
        })
        .collect();
    Table {
        columns: vec![
            "rule",
            "entries",
            "bytes",
            "hits",
            "misses",
            "hit_ratio",
            "stores",
            "evictions",
            "invalidations",
            "bypasses",
            "refreshes",
            "store_bytes",
            "store_limit",
            "row_versions",
            "row_versions_bytes",
        ],
        rows,
    }
}

/// Row-level invalidation (see `cache::rows`): how many counters, and how often reads and
/// writes were known by row.
pub fn show_cache_rows(app: &App) -> Table {
    let f = &app.cache.row_figures;
    let v = &app.cache.versions;
    Table {
        columns: vec![
            "row_versions",
            "row_versions_bytes",
            "point_fills",
            "point_fallbacks",
            "rows_bumped",
            "unknown_rows",
            "column_fills",
            "value_fallbacks",
            "wal_updates_whole",
            "held_fills",
            "wal_own_commits",
        ],
        rows: vec![vec![
            text(v.row_versions()),
            text(v.row_bytes()),
            text(f.point_fills.load(Relaxed)),
            text(f.point_fallbacks.load(Relaxed)),
            text(f.rows_bumped.load(Relaxed)),
            text(f.unknown_rows.load(Relaxed)),
            text(f.column_fills.load(Relaxed)),
            text(f.value_fallbacks.load(Relaxed)),
            text(f.wal_updates_whole.load(Relaxed)),
            text(f.held_fills.load(Relaxed)),
            text(app.cache.own_commits.skipped.load(Relaxed)),
        ]],
    }
}

/// The shared tier (`[cache.shared]`): one row, none without it.
pub fn show_cache_shared(app: &App) -> Table {
    let ms = |us: u64| format!("{:.3}", us as f64 / 1000.0);
    let rows = app.cache.shared().map(|shared| {
        let s = &shared.stats;
        let latency = s.latency();
        let stream_lag = s.stream_lag();
        let leads = app.wal.followers().iter().filter(|f| f.leads()).count();
        vec![
            text(s.hits.load(Relaxed)),
            text(s.misses.load(Relaxed)),
            text(s.refused.load(Relaxed)),
            text(s.errors.load(Relaxed)),
            text(s.timeouts.load(Relaxed)),
            latency.map(|(p50, _)| ms(p50)),
            latency.map(|(_, p99)| ms(p99)),
            text(s.writes.load(Relaxed)),
            text(s.bytes_written.load(Relaxed)),
            text(s.dropped.load(Relaxed)),
            text(leads),
            text(s.stream_published.load(Relaxed)),
            text(s.stream_read.load(Relaxed)),
            stream_lag.map(|(p50, _)| ms(p50)),
            stream_lag.map(|(_, p99)| ms(p99)),
        ]
    });
    Table {
        columns: vec![
            "hits",
            "misses",
            "refused",
            "errors",
            "timeouts",
            "latency_p50_ms",
            "latency_p99_ms",
            "writes",
            "bytes_written",
            "writes_dropped",
            "databases_led",
            "stream_published",
            "stream_read",
            "stream_lag_p50_ms",
            "stream_lag_p99_ms",
        ],
        rows: rows.into_iter().collect(),
    }
}

/// WAL invalidation: one row per database whose replication stream pgmemo follows.
pub fn show_cache_wal(app: &App) -> Table {
    let ms = |us: u64| format!("{:.3}", us as f64 / 1000.0);
    let rows = app
        .wal
        .followers()
        .iter()
        .map(|f| {
            let s = f.status();
            vec![
                text(&s.database),
                text(&s.phase),
                text(f.is_ready()),
                text(s.applied),
                text(s.commits),
                text(s.connects),
                s.lag_us.map(|(p50, _)| ms(p50)),
                s.lag_us.map(|(_, p99)| ms(p99)),
                text(&s.decoder),
            ]
        })
        .collect();
    Table {
        columns: vec![
            "database",
            "state",
            "serving",
            "applied_lsn",
            "commits",
            "connects",
            "lag_p50_ms",
            "lag_p99_ms",
            "decoder",
        ],
        rows,
    }
}

/// Queries a rule or hint chose but the cache did not take, by reason, since start.
pub fn show_cache_bypasses(app: &App) -> Table {
    let rows = crate::query::analysis::BYPASS_REASONS
        .iter()
        .zip(&app.cache.bypasses)
        .map(|(reason, n)| vec![text(reason.as_str()), text(n.get())])
        .collect();
    Table {
        columns: vec!["reason", "queries"],
        rows,
    }
}

/// Every stored result.
pub fn show_cache_entries(app: &App) -> Table {
    let now = std::time::Instant::now();
    let rows = app
        .cache
        .entries()
        .iter()
        .map(|e| {
            vec![
                text(&e.database),
                text(&e.rule.name),
                text(&e.text),
                text(e.tables.join(",")),
                text(e.reply.len()),
                text(e.hits.load(Relaxed)),
                text(format!(
                    "{:.1}",
                    e.expires.saturating_duration_since(now).as_secs_f64()
                )),
            ]
        })
        .collect();
    Table {
        columns: vec![
            "database",
            "rule",
            "query",
            "tables",
            "bytes",
            "hits",
            "expires_in",
        ],
        rows,
    }
}

/// Simple queries that autoprepare passed through, by reason, since start.
pub fn show_autoprepare_reasons(app: &App) -> Table {
    let rows = crate::autoprepare::PASS_REASONS
        .iter()
        .zip(&app.autoprepare.passed)
        .map(|(reason, n)| vec![text(reason), text(n.load(Relaxed))])
        .collect();
    Table {
        columns: vec!["reason", "queries"],
        rows,
    }
}

/// Server connections (open, in use or idle) and clients of the pools `mine` picks.
fn connections(
    pools: &[Arc<crate::pool::Pool>],
    clients: &[Arc<crate::app::ClientInfo>],
    pool_is_mine: impl Fn(&crate::pool::PoolKey) -> bool,
    client_is_mine: impl Fn(&crate::app::ClientInfo) -> bool,
) -> (usize, usize) {
    let servers = pools
        .iter()
        .filter(|p| pool_is_mine(&p.key))
        .map(|p| {
            let (idle, used, _) = p.counts();
            idle + used
        })
        .sum();
    let clients = clients.iter().filter(|c| client_is_mine(c)).count();
    (servers, clients)
}

/// The database names SHOW DATABASES and SHOW LISTS count: the configured ones and those
/// served through `"*"` or `[upstream]` that have a pool (as PgBouncer lists the databases it
/// created on demand). The console's own database is not among them.
fn database_names(config: &crate::config::Config, pools: &[Arc<crate::pool::Pool>]) -> Vec<String> {
    let mut names: Vec<String> = config
        .databases
        .keys()
        .filter(|n| n.as_str() != crate::config::WILDCARD_DATABASE)
        .cloned()
        .chain(pools.iter().map(|p| p.key.database.clone()))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The client users SHOW USERS and SHOW LISTS count: the configured ones and those with a
/// pool or a connection (with no `[users]`, the upstream role).
fn user_names(
    config: &crate::config::Config,
    pools: &[Arc<crate::pool::Pool>],
    clients: &[Arc<crate::app::ClientInfo>],
) -> Vec<String> {
    let mut names: Vec<String> = config
        .users
        .keys()
        .cloned()
        .chain(pools.iter().map(|p| p.key.user.clone()))
        .chain(clients.iter().map(|c| c.user.to_string()))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// PgBouncer's SHOW DATABASES, a row per database name, its settings as `resolve` gives
/// them for a user without settings of its own, its limits (0: none, as in PgBouncer) and
/// its server and client connections.
pub fn show_databases(app: &App) -> Table {
    let config = app.config.load();
    let pools = app.pools();
    let clients = app.clients();
    let star = config.databases.get(crate::config::WILDCARD_DATABASE);
    let rows = database_names(&config, &pools)
        .into_iter()
        .filter_map(|name| {
            let db = config.resolve(&name, "")?;
            let entry = config.databases.get(&name);
            // NULL when inherited from [general], as PgBouncer shows an inherited mode.
            let pool_mode = entry
                .and_then(|e| e.pool_mode)
                .or(star.and_then(|s| s.pool_mode));
            let (servers, clients) = connections(
                &pools,
                &clients,
                |k| k.database == name,
                |c| *c.database == *name,
            );
            // Pools are paused only through the app's record of paused databases.
            let paused = app.is_paused_database(&name);
            // Of several hosts, the primary's once a connection found it.
            let primary = pools.iter().find(|p| p.key.database == name).and_then(|p| {
                let target = &p.settings().target;
                let (host, port) = target.host_at(target.followed_primary()?.host()?)?;
                Some((host.to_string(), port))
            });
            let (host, port) = primary.unwrap_or((db.host.clone(), db.port));
            Some(vec![
                text(&name),
                text(&host),
                text(port),
                text(&db.dbname),
                db.server_user.as_ref().and_then(text),
                text(db.pool_size),
                text(db.min_pool_size),
                text(db.reserve_pool_size),
                text(config.general.server_lifetime.as_secs()),
                pool_mode.map(|m| m.as_str().to_string()),
                None,
                text(db.max_db_connections),
                text(servers),
                text(config.client_limits(&name, "").0),
                text(clients),
                text(u8::from(paused)),
                text(u8::from(app.is_disabled(&name))),
                text(
                    db.replicas
                        .iter()
                        .map(|(h, p)| format!("{h}:{p}"))
                        .collect::<Vec<_>>()
                        .join(","),
                ),
            ])
        })
        .collect();
    Table {
        columns: vec![
            "name",
            "host",
            "port",
            "database",
            "force_user",
            "pool_size",
            "min_pool_size",
            "reserve_pool_size",
            "server_lifetime",
            "pool_mode",
            "load_balance_hosts",
            "max_connections",
            "current_connections",
            "max_client_connections",
            "current_client_connections",
            "paused",
            "disabled",
            "replicas",
        ],
        rows,
    }
}

/// PgBouncer's SHOW USERS: a row per client user, its own pool size and mode (empty and
/// NULL when it has none, as in PgBouncer), its max_user_connections and
/// max_user_client_connections and its connections.
pub fn show_users(app: &App) -> Table {
    let config = app.config.load();
    let pools = app.pools();
    let clients = app.clients();
    let rows = user_names(&config, &pools, &clients)
        .into_iter()
        .map(|name| {
            let user = config.users.get(&name);
            let (servers, clients) =
                connections(&pools, &clients, |k| k.user == name, |c| *c.user == *name);
            vec![
                text(&name),
                text(
                    user.and_then(|u| u.pool_size)
                        .map(|n| n.to_string())
                        .unwrap_or_default(),
                ),
                text(""),
                user.and_then(|u| u.pool_mode)
                    .map(|m| m.as_str().to_string()),
                text(
                    user.and_then(|u| u.max_user_connections)
                        .unwrap_or(config.general.max_user_connections),
                ),
                text(servers),
                text(config.client_limits("", &name).1),
                text(clients),
            ]
        })
        .collect();
    Table {
        columns: vec![
            "name",
            "pool_size",
            "reserve_pool_size",
            "pool_mode",
            "max_user_connections",
            "current_connections",
            "max_user_client_connections",
            "current_client_connections",
        ],
        rows,
    }
}

/// PgBouncer's SHOW LISTS. pgmemo keeps no free lists of client or server objects (its
/// allocator does), has no peers and resolves host names once per connection, so those
/// rows are 0.
pub fn show_lists(app: &App) -> Table {
    let config = app.config.load();
    let pools = app.pools();
    let clients = app.clients();
    let logging_in = clients
        .iter()
        .filter(|c| c.state() == ClientState::Login)
        .count();
    let (servers, _) = connections(&pools, &[], |_| true, |_| false);
    let items = [
        ("databases", database_names(&config, &pools).len()),
        ("users", user_names(&config, &pools, &clients).len()),
        ("peers", 0),
        ("pools", pools.len()),
        ("peer_pools", 0),
        ("free_clients", 0),
        ("used_clients", clients.len()),
        ("login_clients", logging_in),
        ("free_servers", 0),
        ("used_servers", servers),
        ("dns_names", 0),
        ("dns_zones", 0),
        ("dns_queries", 0),
        ("dns_pending", 0),
    ];
    Table {
        columns: vec!["list", "items"],
        rows: items.iter().map(|(k, v)| vec![text(k), text(v)]).collect(),
    }
}

/// PgBouncer's SHOW MEM: a row per kind of object pgmemo keeps per client, server and pool,
/// under PgBouncer's slab names, and the result cache's store.
///
/// - `size`: the object's own size in bytes (a client's ClientInfo; a server's connection
///   state), without the buffers it borrows while busy.
/// - `used`: how many there are now; `memtotal`: size × used (the result cache: its bytes).
/// - `free`: 0. PgBouncer keeps freed objects in slab free lists for reuse; pgmemo gives
///   them back to its allocator.
pub fn show_mem(app: &App) -> Table {
    let pools = app.pools();
    let servers: usize = pools.iter().map(|p| p.servers().len()).sum();
    let (store_bytes, _) = app.cache.memory();
    let objects = [
        (
            "client_cache",
            std::mem::size_of::<crate::app::ClientInfo>(),
            app.client_count(),
        ),
        (
            "server_cache",
            std::mem::size_of::<crate::server::ServerConn>(),
            servers,
        ),
        (
            "pool_cache",
            std::mem::size_of::<crate::pool::Pool>(),
            pools.len(),
        ),
        (
            "prepared_statement_cache",
            std::mem::size_of::<crate::statements::Statement>(),
            app.registry.all().len(),
        ),
    ];
    let mut rows: Vec<Vec<Option<String>>> = objects
        .iter()
        .map(|(name, size, used)| {
            vec![
                text(name),
                text(size),
                text(used),
                text(0),
                text(size * used),
            ]
        })
        .collect();
    rows.push(vec![
        text("result_cache"),
        text(0),
        text(app.cache.usage().values().map(|(n, _)| n).sum::<u64>()),
        text(0),
        text(store_bytes),
    ]);
    Table {
        columns: vec!["name", "size", "used", "free", "memtotal"],
        rows,
    }
}

/// PgBouncer's SHOW FDS: its columns, and no rows. PgBouncer lists (and over its Unix
/// socket, passes) its sockets for an online restart (`-R`, takeover); pgmemo has no online
/// restart, so there is nothing to list or pass on.
pub fn show_fds() -> Table {
    Table {
        columns: vec![
            "fd",
            "task",
            "user",
            "database",
            "addr",
            "port",
            "cancel",
            "link",
            "client_encoding",
            "std_strings",
            "datestyle",
            "timezone",
            "password",
            "scram_client_key",
            "scram_server_key",
        ],
        rows: Vec::new(),
    }
}

/// PgBouncer's SHOW PEERS, PEER_POOLS, DNS_HOSTS and DNS_ZONES: their columns, and no rows.
/// pgmemo has no peers (PgBouncer's cancel forwarding between processes behind one port:
/// pgmemo is one process) and no DNS cache (a host name is resolved at each connect).
pub fn show_nothing_to_list(what: &str) -> Table {
    let columns = match what {
        "peers" => vec!["peer_id", "host", "port", "pool_size"],
        "peer_pools" => vec![
            "peer_id",
            "cl_active_cancel_req",
            "cl_waiting_cancel_req",
            "sv_active_cancel",
            "sv_login",
        ],
        "dns_hosts" => vec!["hostname", "ttl", "addrs"],
        _ => vec!["zonename", "serial", "count"],
    };
    Table {
        columns,
        rows: Vec::new(),
    }
}

pub fn show_config(app: &App) -> Table {
    let rows = app
        .config
        .load()
        .settings_table()
        .into_iter()
        .map(|(k, v, d, c)| {
            vec![
                text(k),
                text(v),
                text(d),
                text(if c { "yes" } else { "no" }),
            ]
        })
        .collect();
    Table {
        columns: vec!["key", "value", "default", "changeable"],
        rows,
    }
}

/// The server databases ([`crate::server::ServerTarget::database_id`]) of the pools whose
/// database is named `name` on its server (or is that id), or of every pool: what the
/// cache's flushes name.
fn server_databases(app: &App, name: Option<&str>) -> Vec<std::sync::Arc<str>> {
    let mut ids: Vec<std::sync::Arc<str>> = app
        .pools()
        .iter()
        .map(|p| p.settings().target.clone())
        .filter(|t| name.is_none_or(|n| t.dbname == n || &*t.database_id == n))
        .map(|t| t.database_id)
        .collect();
    ids.sort();
    ids.dedup();
    if ids.is_empty() {
        // No pool has that name now: entries may still be kept under it as an id.
        ids.extend(name.map(Into::into));
    }
    ids
}

#[cfg(test)]
mod tests {

    #[test]
    fn set_commands_read_as_pgbouncer_reads_them() {
        let set = |sql: &str| super::parse_set(sql);
        let kv = |k: &str, v: &str| Some((k.to_owned(), v.to_owned()));
        assert_eq!(
            set("SET default_pool_size = 30"),
            kv("default_pool_size", "30")
        );
        assert_eq!(
            set("set Default_Pool_Size TO 30 ;"),
            kv("default_pool_size", "30")
        );
        assert_eq!(
            set("SET server_check_query = 'select ''x'''"),
            kv("server_check_query", "select 'x'")
        );
        assert_eq!(set("SET \"DateStyle\"='ISO'"), kv("DateStyle", "ISO"));
        assert_eq!(set("SET x = ''"), kv("x", ""));
        for not in [
            "SET",
            "SET x",
            "SET x =",
            "SET x = 1 + 1",
            "SETx = 1",
            "SET x = 'open",
            "SHOW x",
        ] {
            assert_eq!(set(not), None, "{not}");
        }
    }

    #[test]
    fn unix_time_formatting() {
        assert_eq!(super::format_unix(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(super::format_unix(1_700_000_000), "2023-11-14 22:13:20 UTC");
    }
}
