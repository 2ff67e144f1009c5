//! The `[general]` settings, one entry each: PgBouncer's `bouncer_params[]` for pgmemo.
//!
//! Each entry gives the key, its type, its default, whether a RELOAD changes it (`Live`) or
//! only a restart does (`Restart`), what its value must satisfy, and its documentation (the
//! doc comment). `table.rs`'s `settings!` generates from this the `General` struct and its
//! `Default`, the reading of the file with an error per key, the checks, SHOW CONFIG's rows
//! and the reference (`General::reference`, which a test holds `pgmemo.example.toml` to).
//!
//! A new setting is one entry here, plus its paragraph in `pgmemo.example.toml`.
//!
//! The checks below the table are the ones more than one entry uses, or too long for a line.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::table::{ensure, settings};
use super::{AuthType, ClientTlsMode, LogFormat, PoolMode, ReplicaLag, ServerTlsMode};

settings! {
    /// `[general]`: settings of the whole process, and the defaults of every pool.
    /// Generated from the table in `config/settings.rs`.
    [general] General from RawGeneral;

    /// Address clients connect to, `HOST:PORT` (IPv6 as `[::1]:6432`; port 0 picks a free
    /// port).
    listen: String = "127.0.0.1:6432".into(), Restart,
        check = |v, _| parse_host_port(v).map(drop);
    /// Default pool mode of every pool.
    pool_mode: PoolMode = PoolMode::Transaction, Live;
    /// Server connections per (database, user) pool, unless the database or user says
    /// otherwise.
    default_pool_size: u32 = 20, Live, check = at_least_one;
    /// Server connections each pool keeps open even when idle.
    min_pool_size: u32 = 0, Live,
        check = |v, g| ensure(*v <= g.default_pool_size, || {
            format!("must not exceed general.default_pool_size ({})", g.default_pool_size)
        });
    /// Client connections accepted at once; more are refused with 53300.
    max_client_conn: u32 = 1000, Live, check = at_least_one;
    /// How clients authenticate to pgmemo; `trust` is refused unless `listen` is a loopback
    /// address; `cert`: a TLS client certificate (checked against `tls_ca_file`) whose Common
    /// Name is the user.
    auth_type: AuthType = AuthType::ScramSha256, Live, check = trust_only_on_loopback;
    /// PgBouncer's auth file (`userlist.txt`): `"user" "secret"` per line, the secret a plain
    /// password, an md5 hash or a SCRAM verifier; `;` starts a comment line. Its users may log
    /// in besides `[users]` (whose `password` wins for a user in both). Read again on
    /// RELOAD. Relative paths are relative to the config file.
    auth_file: Option<PathBuf> = None, Live;
    /// With `auth_type = "hba"`: the file (PostgreSQL's `pg_hba.conf` format, as PgBouncer
    /// reads it) whose first matching line gives each connection its method: `local`, `host`,
    /// `hostssl`, `hostnossl`; `trust`, `reject`, `md5`, `scram-sha-256`, `peer` (local lines),
    /// `cert` (hostssl lines); `@file` name lists. Read again on RELOAD. Relative paths are
    /// relative to the config file.
    auth_hba_file: Option<PathBuf> = None, Live;
    /// With `auth_type = "hba"`, PgBouncer's user name maps: lines of `MAPNAME SYSTEM-USERNAME
    /// DATABASE-USERNAME` (the database name a user or `all`) that HBA lines of method `peer`
    /// or `cert` name with `map=MAPNAME`; such a line lets the client whose operating-system
    /// user (peer) or certificate Common Name (cert) is the system name log in as that user.
    /// Read with the HBA file (RELOAD). Relative paths are relative to the config file.
    auth_ident_file: Option<PathBuf> = None, Live;
    /// The role whose server connection looks up, with `auth_query`, the secret of a client
    /// that neither `[users]` nor `auth_file` lists. It logs into the server as itself, with
    /// `[upstream]`'s password when it is the upstream's user, else its plain password from
    /// `[users]` / `auth_file` (or the database's `password` when it is the database's fixed
    /// `user`). Default: no lookup.
    auth_user: Option<String> = None, Live;
    /// The query that returns (user name, secret) for the client's user name, `$1`;
    /// PgBouncer 1.25's default. Answers are cached for 30 seconds.
    auth_query: String = DEFAULT_AUTH_QUERY.into(), Live,
        check = |v, _| ensure(v.contains("$1"), || "must use $1, the user name".into());
    /// The database `auth_query` runs in. Default: the one the client asks for.
    auth_dbname: Option<String> = None, Live;
    /// Users allowed to connect to the admin console, the database `pgmemo`.
    admin_users: Vec<String> = Vec::new(), Live;
    /// Users allowed a read-only console: SHOW commands (but SHOW FDS), as PgBouncer's
    /// `stats_users`; any other command gets ERROR 08P01 `admin access needed`.
    stats_users: Vec<String> = Vec::new(), Live;
    /// Address of the Prometheus metrics endpoint, `HOST:PORT`. Default: no endpoint.
    metrics_listen: Option<String> = None, Restart,
        check = |v, _| v.as_deref().map_or(Ok(()), |v| parse_host_port(v).map(drop));
    /// Directory of a Unix socket pgmemo listens on besides `listen`: the socket is
    /// `<dir>/.s.PGSQL.<listen port>`, so `psql -h DIR -p PORT` reaches it. A stale socket
    /// file there is replaced; another process listening there stops the start. Default:
    /// none (PgBouncer's is /tmp: off here so that pgmemo never takes the socket of a
    /// PostgreSQL on the same machine and port).
    unix_socket_dir: Option<PathBuf> = None, Restart;
    /// File mode of that socket, in octal: 0777 lets every local user connect (they still
    /// log in); 0770 only the owner's group.
    unix_socket_mode: String = "0777".into(), Restart, check = |v, _| parse_mode(v).map(drop);
    /// Group of that socket (a name or a number), for `unix_socket_mode = "0770"`; pgmemo's
    /// user must belong to it. Default: pgmemo's own group.
    unix_socket_group: Option<String> = None, Restart;
    /// Online restart: a pgmemo started with `--takeover` takes over the listening sockets
    /// and the idle clients of the one running, over a Unix socket only pgmemo's own user may
    /// connect to (`takeover_socket`). Off: no such socket, and `--takeover` finds nothing.
    online_restart: bool = true, Restart;
    /// That socket's path. Default: `<unix_socket_dir>/.s.PGSQL.<port>.takeover`, or
    /// `/tmp/.s.pgmemo.<port>.takeover` without `unix_socket_dir` (`<port>`: `listen`'s).
    takeover_socket: Option<PathBuf> = None, Restart;
    /// A client waiting longer than this for a server gets FATAL 08P01 `query_wait_timeout`
    /// and is disconnected, as with PgBouncer.
    query_wait_timeout: Duration = Duration::from_secs(120), Live, check = positive;
    /// A client waiting this long for a server is told so with a NOTICE (`No server connection
    /// available in postgres backend, client being queued`), once per wait, as PgBouncer's
    /// `query_wait_notify`. 0: never.
    query_wait_notify: Duration = Duration::from_secs(5), Live;
    /// A client whose query (from its first message that needs a server, waiting for one
    /// included, to the end of its reply) runs longer than this is closed with FATAL 08P01
    /// `query timeout` (`query_timeout` while it waited), its query cancelled and its server
    /// closed, as PgBouncer's; checked each second. Use it a little above PostgreSQL's
    /// `statement_timeout`, for network trouble. 0: no limit.
    query_timeout: Duration = Duration::ZERO, Live;
    /// A client idle in a transaction (its server's last ReadyForQuery said T or E) for
    /// this long is closed with FATAL 08P01 `idle transaction timeout`, as PgBouncer's; its
    /// transaction is rolled back and the server goes back to the pool (PgBouncer closes
    /// it); checked each second. 0: never.
    idle_transaction_timeout: Duration = Duration::ZERO, Live;
    /// A client that holds no server and sends nothing for this long is closed with FATAL
    /// 08P01 `client_idle_timeout`, as PgBouncer's; checked each second. 0: never.
    client_idle_timeout: Duration = Duration::ZERO, Live;
    /// A client whose transaction has been open this long (from its first query after the
    /// server was idle, waiting for a server included, a single statement's implicit
    /// transaction too, to the end of the transaction; running or idle) is closed with FATAL 08P01 `transaction timeout`, as
    /// PgBouncer's; its transaction is rolled back (a running query cancelled and its server
    /// closed); checked each second. 0: never. Per user too.
    transaction_timeout: Duration = Duration::ZERO, Live;
    /// Server connections to one database (the name clients ask for) across all its
    /// pools; a pool at the limit makes its clients wait, and closes an idle server of
    /// another pool of the database for them, as PgBouncer's `max_db_connections`. 0: no
    /// limit. Per database too.
    max_db_connections: u32 = 0, Live;
    /// Server connections of one user (the client's user, the pool's key) across all its
    /// pools, as `max_db_connections` for a database. 0: no limit. Per user too.
    max_user_connections: u32 = 0, Live;
    /// Client connections to one database (the name clients ask for) at once; a client
    /// over the limit is refused at login with PgBouncer's FATAL 08P01 `client connections
    /// exceeded (max_db_client_connections)`. The admin console is not counted. 0: no
    /// limit. Per database too.
    max_db_client_connections: u32 = 0, Live;
    /// Client connections of one user at once, as `max_db_client_connections` for a
    /// database (FATAL 08P01 `client connections exceeded (max_user_client_connections)`).
    /// 0: no limit. Per user too.
    max_user_client_connections: u32 = 0, Live;
    /// Extra server connections a pool may open for a client that has waited
    /// `reserve_pool_timeout`, as PgBouncer's. 0: none. Per database too.
    reserve_pool_size: u32 = 0, Live;
    /// How long a client waits for a server before the reserve pool may serve it.
    reserve_pool_timeout: Duration = Duration::from_secs(5), Live, check = positive;
    /// Total time for connecting to a server, retries included, before the waiting client
    /// gets an error.
    server_connect_timeout: Duration = Duration::from_secs(15), Live, check = positive;
    /// A server idle in its pool longer than this is closed (down to `min_pool_size`).
    server_idle_timeout: Duration = Duration::from_secs(600), Live, check = positive;
    /// A server older than this is closed when it is next released.
    server_lifetime: Duration = Duration::from_secs(3600), Live, check = positive;
    /// A server idle longer than this is checked with `server_check_query` before it is
    /// lent out again; 0 checks every time.
    server_check_delay: Duration = Duration::from_secs(30), Live;
    /// SHOW STATS' `avg_*` columns are averages from the period boundary before the last to
    /// now (one to two periods), as PgBouncer's `stats_period`.
    stats_period: Duration = Duration::from_secs(60), Live, check = positive;
    /// The query of that health check; `;` (an empty query) is one round trip.
    server_check_query: String = ";".into(), Live,
        check = |v, _| ensure(!v.trim().is_empty(), || {
            "must not be empty (\";\" is the cheapest check)".into()
        });
    /// TCP keepalive on client and server sockets (`SO_KEEPALIVE`), as PgBouncer's; the
    /// three settings below tune its probes (Linux), 0 leaving the system's value.
    tcp_keepalive: bool = true, Live;
    /// Idle time before the first keepalive probe (`TCP_KEEPIDLE`, whole seconds); 0: the
    /// system's (`net.ipv4.tcp_keepalive_time`, 7200 by default).
    tcp_keepidle: Duration = Duration::ZERO, Live;
    /// Time between keepalive probes (`TCP_KEEPINTVL`, whole seconds); 0: the system's.
    tcp_keepintvl: Duration = Duration::ZERO, Live;
    /// Unanswered keepalive probes before the connection is dropped (`TCP_KEEPCNT`); 0: the
    /// system's.
    tcp_keepcnt: u32 = 0, Live;
    /// How long sent data may stay unacknowledged before the connection is dropped
    /// (`TCP_USER_TIMEOUT`, Linux; PgBouncer's is in milliseconds, this in seconds, 0.5 for
    /// 500 ms); 0: the system's.
    tcp_user_timeout: Duration = Duration::ZERO, Live;
    /// A client must finish startup and authentication within this.
    client_login_timeout: Duration = Duration::from_secs(60), Live, check = positive;
    /// On SIGINT / `SHUTDOWN WAIT_FOR_SERVERS`, and for the old process of an online restart,
    /// how long running transactions may finish before their connections are closed; 0
    /// closes at once.
    shutdown_timeout: Duration = Duration::from_secs(30), Live;
    /// Run on a server after a session-mode client leaves, before the next client gets it;
    /// empty means no reset.
    server_reset_query: String = "DISCARD ALL".into(), Live;
    /// Also run `server_reset_query` in transaction mode after every transaction.
    server_reset_query_always: bool = false, Live;
    /// Hand out the idle server that has waited longest (PgBouncer's `server_round_robin`),
    /// so that every server connection, and every host of a balanced host list, takes its
    /// share of the queries; by default the most recently used one (fewer servers kept warm).
    server_round_robin: bool = false, Live;
    /// Largest message accepted from a client or server, in bytes (1 KiB to 1 GiB); a
    /// longer one ends that connection with 08P01.
    max_message_size: usize = 64 << 20, Live, range = MESSAGE_SIZE_RANGE,
        check = |v, _| ensure(MESSAGE_SIZE.contains(v), || {
            format!("must be {MESSAGE_SIZE_RANGE}")
        });
    /// PEM certificate chain for client-facing TLS (set together with `tls_key_file`).
    /// Relative paths are relative to the config file.
    tls_cert_file: Option<PathBuf> = None, Live,
        check = |v, g| ensure(v.is_none() || g.tls_key_file.is_some(), || {
            "set tls_key_file too".into()
        });
    /// PEM private key for client-facing TLS (set together with `tls_cert_file`).
    tls_key_file: Option<PathBuf> = None, Live,
        check = |v, g| ensure(v.is_none() || g.tls_cert_file.is_some(), || {
            "set tls_cert_file too".into()
        });
    /// The TLS versions offered to clients, as PgBouncer's `client_tls_protocols`: `secure`
    /// (TLS 1.2 and 1.3), `tlsv1.3`, `tlsv1.2`, or a list; `all` / `legacy` allow the older
    /// ones too, which pgmemo's TLS does not speak.
    tls_protocols: String = "secure".into(), Live,
        check = |v, _| super::choices::tls_protocols(v).map(|_| ());
    /// Client-facing TLS: `disable`, `allow`, `require`, or `verify-ca` / `verify-full`
    /// (TLS with a client certificate that chains to `tls_ca_file`). Default `allow` when a
    /// certificate and key are set, else `disable`.
    client_tls: ClientTlsMode = ClientTlsMode::Disable, Live,
        unset = |g| match (&g.tls_cert_file, &g.tls_key_file) {
            (Some(_), Some(_)) => ClientTlsMode::Allow,
            _ => ClientTlsMode::Disable,
        },
        check = |v, g| ensure(*v == ClientTlsMode::Disable || g.tls_cert_file.is_some(), || {
            format!("{:?} needs tls_cert_file and tls_key_file", v.as_str())
        }).and_then(|()| ensure(!v.requires_certificate() || g.tls_ca_file.is_some(), || {
            format!("{:?} needs tls_ca_file (the CA client certificates chain to)", v.as_str())
        }));
    /// PEM CA certificates that TLS clients' certificates are checked against: with it,
    /// pgmemo asks each TLS client for a certificate (which `client_tls = "verify-ca"`
    /// requires and `auth_type = "cert"` or an HBA `cert` line logs in with).
    tls_ca_file: Option<PathBuf> = None, Live,
        check = |v, g| ensure(v.is_none() || g.tls_cert_file.is_some(), || {
            "set tls_cert_file and tls_key_file too".into()
        });
    /// TLS towards the servers.
    server_tls: ServerTlsMode = ServerTlsMode::Disable, Live;
    /// PEM CA certificates that server certificates are checked against (`verify-full`).
    /// Default: the well-known web roots.
    server_tls_ca_file: Option<PathBuf> = None, Live;
    /// A PEM client certificate pgmemo presents to servers that ask for one (a pg_hba.conf
    /// `cert` line, `clientcert=verify-ca` / `verify-full`), with `server_tls_key_file`.
    /// PgBouncer's setting; a connection string's `sslcert` is over it for its server.
    server_tls_cert_file: Option<PathBuf> = None, Live,
        check = |v, g| ensure(v.is_some() == g.server_tls_key_file.is_some(), || {
            "set server_tls_cert_file and server_tls_key_file together".into()
        });
    /// The private key (PEM) of `server_tls_cert_file`.
    server_tls_key_file: Option<PathBuf> = None, Live;
    /// The TLS versions pgmemo offers servers, as `tls_protocols` (PgBouncer's
    /// `server_tls_protocols`).
    server_tls_protocols: String = "secure".into(), Live,
        check = |v, _| super::choices::tls_protocols(v).map(|_| ());
    /// Keep prepared statements working in transaction mode by preparing them on whichever
    /// server runs them.
    prepared_statements: bool = true, Restart;
    /// Prepared statements kept per server connection; the least recently used beyond this
    /// are closed on the server.
    max_prepared_statements: u32 = 500, Restart, check = at_least_one;
    /// Run simple-protocol queries as shared prepared statements, their literals made
    /// parameters (see docs/autoprepare.md); per database and user too.
    autoprepare: bool = true, Live;
    /// Transaction mode: carry each client's session settings (SET, SET ROLE, ...) from
    /// server to server and pin a client to its server while it holds state that cannot be
    /// carried (temporary tables, LISTEN, advisory locks, WITH HOLD cursors, LOAD); see
    /// docs/session-state.md. `false` is PgBouncer's behaviour: what a client sets
    /// stays on the server. Per database and user too.
    pin_session_state: bool = true, Live;
    /// A client pinned to its server (see `pin_session_state`) that sends nothing for this
    /// long, outside a transaction, is closed with FATAL 08P01 `pinned_idle_timeout` and its
    /// server cleaned and given back; 0 never closes it, and is the default: a LISTEN client
    /// is pinned and may rightly wait hours for a notification; `max_pinned_fraction` bounds
    /// what pinned clients can hold.
    pinned_idle_timeout: Duration = Duration::ZERO, Live;
    /// At most this fraction of a pool's `pool_size` (rounded up) may be held by pinned clients; a
    /// simple query that may pin one more (its text names a temporary object, LISTEN, an advisory
    /// lock or a held cursor) waits for a pinned client to unpin or leave before it takes a server,
    /// as a client waits for a server (FATAL 08P01 `query_wait_timeout` at most); a pin pgmemo
    /// could not foresee is counted over the bound. 0 refuses every pin, 1 bounds nothing; with 0.5
    /// the other half always serves unpinned clients.
    max_pinned_fraction: f64 = 0.5, Live,
        check = |v, _| ensure((0.0..=1.0).contains(v), || "must be 0..=1".into());
    /// With replicas (`replicas` in `[upstream]` or a database, `--replica`): how long a read
    /// whose client's last write (or `pgmemo.min_read_lsn`) no replica has replayed yet waits
    /// for one to replay it before it goes to the primary instead. 0: at once.
    replica_wait: Duration = Duration::from_millis(50), Live;
    /// A replica further behind its primary than this takes no reads until it catches up: a
    /// time (`"10s"`, `"500ms"`, or a number of seconds) or an amount of WAL (`"16MB"`).
    max_replica_lag: ReplicaLag = ReplicaLag::default(), Live;
    /// Session mode: clients share prepared statements through the registry (pgmemo's own
    /// `pgmemo_s<n>` names on servers, autoprepare and the result cache for them), as in
    /// transaction mode. `false`: a session-mode client's statements go to its server under
    /// its own names, as on a direct connection.
    session_shared_statements: bool = false, Live;
    /// Uses of a query shape before it is prepared.
    autoprepare_threshold: u32 = 2, Live;
    /// Query shapes remembered (with what was decided for each), least useful dropped
    /// first.
    autoprepare_max_shapes: u32 = 10_000, Live;
    /// Log filter: a level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or
    /// tracing-style directives such as `pgmemo=debug,info`.
    log_level: String = "info".into(), Restart, check = |v, _| check_log_level(v);
    /// `text` (ANSI colours only on a terminal) or `json` (one object per line).
    log_format: LogFormat = LogFormat::Text, Restart;
    /// Append the client's address and port to its `application_name` (`app - 10.0.0.5:51234`;
    /// `app` when it gives none), as PgBouncer's `application_name_add_host`: a slow query in
    /// `pg_stat_activity` then says which client host sent it. New clients only.
    application_name_add_host: bool = false, Live;
    /// Log each client's login (its database, user and whether it uses TLS), as PgBouncer's
    /// `log_connections`. Logins refused are logged whatever this says.
    log_connections: bool = true, Live;
    /// Log each client's end, why (`client close request`, `client unexpected eof`, or the
    /// error it was told) and how long it was connected, as PgBouncer's `log_disconnections`.
    log_disconnections: bool = true, Live;
    /// Log, every `stats_period`, the averages of every pool over it, as PgBouncer's
    /// `log_stats`: `stats: 812 xacts/s, 2436 queries/s, 0 client parses/s, 0 server
    /// parses/s, 0 binds/s, in 98112 B/s, out 401233 B/s, xact 1520 us, query 402 us, wait 3
    /// us`.
    log_stats: bool = true, Live;
    /// Threads serving clients, each with an event loop of its own; a client goes to the one
    /// of the CPU its packets arrive on, and follows them between transactions (see
    /// docs/pooling.md). 1 is PgBouncer's; more serve more result-cache hits at once.
    workers: u32 = 1, Restart,
        check = |v, _| ensure((1..=MAX_WORKERS).contains(v), || {
            format!("must be between 1 and {MAX_WORKERS}")
        });
}

/// PgBouncer 1.25's `auth_query`.
const DEFAULT_AUTH_QUERY: &str = "SELECT rolname, CASE WHEN rolvaliduntil < now() THEN NULL \
    ELSE rolpassword END FROM pg_authid WHERE rolname=$1 AND rolcanlogin";

impl General {
    /// What the `tcp_*` settings set on each client and server socket.
    pub fn keepalive(&self) -> crate::keepalive::Keepalive {
        crate::keepalive::Keepalive {
            enabled: self.tcp_keepalive,
            idle: self.tcp_keepidle,
            interval: self.tcp_keepintvl,
            count: self.tcp_keepcnt,
            user_timeout: self.tcp_user_timeout,
        }
    }
}

/// The most worker threads `general.workers` may ask for.
const MAX_WORKERS: u32 = 64;

/// `max_message_size`: PostgreSQL itself never sends or accepts a message over 1 GiB.
const MESSAGE_SIZE: std::ops::RangeInclusive<usize> = 1024..=1 << 30;
/// Those bounds, as the messages say them.
const MESSAGE_SIZE_RANGE: &str = "1024..=1073741824 bytes";

fn at_least_one(v: &u32, _: &General) -> Result<(), String> {
    ensure(*v > 0, || "must be at least 1".into())
}

/// For timeouts, where 0 would mean "fail at once".
fn positive(v: &Duration, _: &General) -> Result<(), String> {
    ensure(!v.is_zero(), || "must be more than 0 seconds".into())
}

fn trust_only_on_loopback(v: &AuthType, g: &General) -> Result<(), String> {
    // A listen address that does not parse is `listen`'s error, reported before this one.
    let Ok((host, _)) = parse_host_port(&g.listen) else {
        return Ok(());
    };
    if *v != AuthType::Trust || is_loopback(&host) {
        return Ok(());
    }
    Err(format!(
        "\"trust\" lets anyone in without a password, so it is only allowed when \
         general.listen is a loopback address (127.0.0.1, ::1 or localhost), not \
         {:?}; use md5 or scram-sha-256 (--auth), or listen on 127.0.0.1 (--listen)",
        g.listen
    ))
}

/// Accepts the common forms of a tracing `EnvFilter`: comma-separated `LEVEL` or
/// `TARGET=LEVEL`.
fn check_log_level(s: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let is_level = |l: &str| LEVELS.iter().any(|x| x.eq_ignore_ascii_case(l));
    let bad = || {
        format!(
            "expected a level (off, error, warn, info, debug, trace) or directives like \
             \"pgmemo=debug,info\", got {s:?}"
        )
    };
    if s.trim().is_empty() {
        return Err(bad());
    }
    for part in s.split(',') {
        let part = part.trim();
        let ok = match part.split_once('=') {
            Some((target, level)) => {
                !target.is_empty()
                    && target
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
                    && is_level(level)
            }
            // A bare word must be a level: a misspelt level would otherwise be read as a
            // target name and silently log nothing.
            None => is_level(part),
        };
        if !ok {
            return Err(bad());
        }
    }
    Ok(())
}

/// Reads a file mode in octal (`0777`, `770`), at most 0777.
pub fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("expected a file mode in octal, 0000 to 0777, got {s:?}"))
}

/// Splits `HOST:PORT` (IPv6 as `[::1]:PORT`) into host (without brackets) and port.
/// Port 0 is allowed: the system then picks a free port.
pub fn parse_host_port(s: &str) -> Result<(String, u16), String> {
    let bad = || format!("expected HOST:PORT, like 127.0.0.1:6432 or [::1]:6432, got {s:?}");
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (host, rest) = rest.split_once(']').ok_or_else(bad)?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("{host:?} in brackets is not an IPv6 address"));
        }
        (host, rest.strip_prefix(':').ok_or_else(bad)?)
    } else {
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        if host.contains(':') {
            return Err(format!(
                "put an IPv6 address in brackets, like [::1]:6432, got {s:?}"
            ));
        }
        (host, port)
    };
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("the port in {s:?} must be a number 0..=65535"))?;
    Ok((host.to_string(), port))
}

/// Whether a listen host only accepts connections from this machine.
fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<IpAddr>()
            .map(|ip| ip.is_loopback())
            .unwrap_or(false)
}
