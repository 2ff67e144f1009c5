//! One connection from pgmemo to a PostgreSQL server: connecting, logging in, the parameters
//! it reports, and the small request/response exchanges pgmemo runs on it by itself (parameter
//! sync, reset, health check). The hot path — forwarding a client's batch — lives in `session`,
//! which works on the buffers here directly.

use crate::clock::Moment;
use crate::config::HostOrder;
use crate::config::SessionAttrs;
use crate::params::Vars;
use crate::protocol::backend::{self, AuthRequest, ErrorFields};
use crate::protocol::startup::Replication;
use crate::protocol::{frame, frontend, MAX_BACKEND_MESSAGE_SIZE};
use crate::stream::Stream;
use crate::tls::ServerTlsMode;
use bytes::{Buf, Bytes, BytesMut};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Where and as whom a pool's server connections log in.
#[derive(Clone)]
pub struct ServerTarget {
    pub host: String,
    pub port: u16,
    pub dbname: String,
    /// The server database as the caches and registries key it: `host:port/dbname`. Two
    /// database entries may name databases of the same name on different servers, and what
    /// is known of one (cached results, statements, table versions) is not the other's.
    pub database_id: std::sync::Arc<str>,
    pub user: String,
    pub password: Option<String>,
    /// Without a password: the keys of the client's SCRAM login, to log in as it
    /// (SCRAM pass-through).
    pub scram_keys: Option<crate::auth::ScramKeys>,
    pub tls_mode: ServerTlsMode,
    pub tls: Option<tokio_rustls::TlsConnector>,
    /// Further servers to try in order when `host:port` cannot be used: the other hosts of
    /// a libpq connection string (`host=a,b port=5432,5433`). A host that starts with `/` is
    /// a Unix socket directory, here as in `host`.
    pub fallbacks: Vec<(String, u16)>,
    /// libpq's `target_session_attrs`: a server that is not what it asks for (a standby
    /// where writes are wanted, ...) is passed over for the next host.
    pub session_attrs: SessionAttrs,
    /// Which host is the primary (with `read-write` or `primary`), shared by every target of
    /// the same hosts (see [`crate::primary`]).
    pub primary: Arc<crate::primary::Primary>,
    /// libpq's `connect_timeout`: how long each host may take, login included.
    pub connect_timeout: Option<Duration>,
    /// Sent in the startup packet, the server's default for sessions that set none.
    pub application_name: Option<String>,
    /// TCP keepalive and user timeout set on the socket (the `tcp_*` settings).
    pub keepalive: crate::keepalive::Keepalive,
    /// Where a new connection starts in `host` and the fallbacks (`load_balance_hosts`).
    pub order: HostOrder,
    /// The round-robin's next start, shared by the target's copies.
    pub turn: Arc<std::sync::atomic::AtomicUsize>,
}

impl ServerTarget {
    /// Every server to try for a new connection, in order: `host:port`, then the fallbacks;
    /// with `load_balance_hosts` round-robin or random, the same list started at the next
    /// host or at one chosen at random, and wrapped around.
    pub fn hosts(&self) -> impl Iterator<Item = (usize, &str, u16)> {
        let count = 1 + self.fallbacks.len();
        let start = match self.order {
            HostOrder::InOrder => 0,
            HostOrder::RoundRobin => self.turn.fetch_add(1, Ordering::Relaxed) % count,
            HostOrder::Random => rand::random::<u32>() as usize % count,
        };
        (0..count).map(move |i| match (start + i) % count {
            0 => (0, self.host.as_str(), self.port),
            n => {
                let (host, port) = &self.fallbacks[n - 1];
                (n, host.as_str(), *port)
            }
        })
    }

    /// The host at `index` of [`ServerTarget::hosts`]' list, as written.
    pub fn host_at(&self, index: usize) -> Option<(&str, u16)> {
        match index {
            0 => Some((self.host.as_str(), self.port)),
            n => self.fallbacks.get(n - 1).map(|(h, p)| (h.as_str(), *p)),
        }
    }

    /// The hosts' primary when pgmemo follows it (`target_session_attrs` `read-write` or
    /// `primary`, see [`crate::primary`]).
    pub fn followed_primary(&self) -> Option<Arc<crate::primary::Primary>> {
        self.session_attrs
            .wants_primary()
            .then(|| self.primary.clone())
    }

    /// A key naming the list of hosts (what [`crate::primary::Primary`] is shared by).
    pub fn hosts_key(&self) -> String {
        let mut key = format!("{}:{}", self.host, self.port);
        for (host, port) in &self.fallbacks {
            key.push_str(&format!(",{host}:{port}"));
        }
        key
    }
}

/// Whether a server host is a Unix socket directory (libpq: a host that starts with `/`).
pub fn is_socket_dir(host: &str) -> bool {
    host.starts_with('/')
}

/// The socket file of the server listening on `port` in directory `dir`, as libpq names it.
pub fn socket_path(dir: &str, port: u16) -> std::path::PathBuf {
    std::path::Path::new(dir).join(format!(".s.PGSQL.{port}"))
}

impl ServerTarget {
    /// [`ServerTarget::database_id`] for a server at `host:port` and its database `dbname`.
    pub fn database_id(host: &str, port: u16, dbname: &str) -> std::sync::Arc<str> {
        format!("{host}:{port}/{dbname}").into()
    }
}

impl std::fmt::Debug for ServerTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}@{}:{}/{}",
            self.user, self.host, self.port, self.dbname
        )
    }
}

/// Why a server connection could not be made or used.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The server answered with an ErrorResponse; `raw` is the message body so a client can be
    /// shown exactly what PostgreSQL said.
    #[error("server error {}: {}", .fields.code, .fields.message)]
    Server { fields: ErrorFields, raw: Bytes },
    #[error("{0}")]
    Protocol(String),
}

/// Lifecycle states shown by `SHOW SERVERS` (PgBouncer's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ServerState {
    Login = 0,
    Idle = 1,
    Active = 2,
    Used = 3,
    Tested = 4,
}

impl ServerState {
    pub fn name(self) -> &'static str {
        match self {
            ServerState::Login => "login",
            ServerState::Idle => "idle",
            ServerState::Active => "active",
            ServerState::Used => "used",
            ServerState::Tested => "tested",
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => ServerState::Login,
            1 => ServerState::Idle,
            2 => ServerState::Active,
            3 => ServerState::Used,
            _ => ServerState::Tested,
        }
    }
}

/// What the admin console sees of a server connection; shared so it can be listed while a
/// session owns the connection itself.
#[derive(Debug)]
pub struct ServerInfo {
    pub id: u64,
    pub addr: SocketAddr,
    pub local_addr: SocketAddr,
    pub backend_pid: i32,
    /// The socket file of a server reached over a Unix socket (`addr` is then unspecified).
    pub unix_socket: Option<Arc<std::path::PathBuf>>,
    pub connect_time: std::time::SystemTime,
    /// When the connection was opened (server_lifetime, RECONNECT).
    pub created: Moment,
    pub tls: bool,
    /// Its host's place in its target's list ([`ServerTarget::hosts`]).
    pub host_index: usize,
    /// A replication connection (a replication client's own server), SHOW SERVERS'
    /// `replication`; never one of the pool's shared servers.
    pub replication: Replication,
    state: AtomicU8,
    /// Id of the client using it, 0 when none.
    pub client_id: AtomicU64,
    /// The process ID (BackendKeyData's) of the client that last held it, kept after it left:
    /// a NOTIFY that client sent here reaches listeners with this server's process ID, which
    /// they compare with the one the notifier was given (see `App::notifier_pid`).
    pub client_pid: AtomicI32,
    /// Statements prepared here, and this connection's prepared-statement counters (updated
    /// when a client gives it back, for SHOW SERVERS).
    pub prepared_statements: AtomicU64,
    pub prepare_cache_hit: AtomicU64,
    pub prepare_cache_miss: AtomicU64,
    pub prepare_evictions: AtomicU64,
    /// When the connection was last handed to a client or given back, in microseconds since
    /// `created` (SHOW SERVERS' request_time): from clock reads the pool makes anyway.
    request_us: AtomicU64,
}

impl ServerInfo {
    /// Notes that the connection was handed over or given back at `now`.
    #[inline]
    pub fn note_request(&self, now: Moment) {
        let us = now.micros_since(self.created);
        self.request_us.store(us, Ordering::Relaxed);
    }

    /// When the connection was last handed to a client or given back.
    pub fn request_time(&self) -> std::time::SystemTime {
        self.connect_time
            + std::time::Duration::from_micros(self.request_us.load(Ordering::Relaxed))
    }

    pub fn state(&self) -> ServerState {
        ServerState::from_u8(self.state.load(Ordering::Relaxed))
    }

    /// Where a CancelRequest for this connection's backend goes.
    pub fn cancel_addr(&self) -> CancelAddr {
        match &self.unix_socket {
            Some(path) => CancelAddr::Unix(path.clone()),
            None => CancelAddr::Tcp(self.addr),
        }
    }
}

/// Where a server's CancelRequests go: its address, or its socket file. An enum, not a
/// second field, so that every client's record of its server stays as small as it was.
#[derive(Debug, Clone)]
pub enum CancelAddr {
    Tcp(SocketAddr),
    Unix(Arc<std::path::PathBuf>),
}

static NEXT_SERVER_ID: AtomicU64 = AtomicU64::new(1);

pub struct ServerConn {
    pub stream: Stream,
    pub rbuf: BytesMut,
    pub wbuf: BytesMut,
    pub info: Arc<ServerInfo>,
    /// The server's BackendKeyData, for forwarding cancel requests.
    pub backend_secret: i32,
    /// Reported parameters, as of the last ParameterStatus for each ([`ServerConn::reported`],
    /// changed only by [`ServerConn::set_reported`]).
    reported: Vars,
    /// A client's reported parameters (the copy clients with the same share, see
    /// `Pool::share_reported`) found equal to `reported` and not changed since: the next
    /// client with that copy is known to match without comparing them. Held here, the copy
    /// cannot change (a client that changes one makes its own); forgotten when `reported`
    /// changes.
    reported_as: Option<Arc<Vars>>,
    /// Unreported settings pgmemo has SET on this connection.
    pub settings: Vars,
    /// Transaction status from the last ReadyForQuery.
    pub status: u8,
    /// A statement completed since that ReadyForQuery (in an extended-protocol batch, before
    /// its Sync): the block `status` reported may have ended since. In an aborted block only a
    /// COMMIT, ROLLBACK or ROLLBACK TO completes, and a Bind after it is not refused.
    pub completed_since_ready: bool,
    pub last_used: Moment,
    /// When the pool last handed it out (the start of the holder's transaction time).
    pub checked_out: Moment,
    /// (client id, the client's parameter version) whose parameters this connection was last
    /// made to match; while it still matches, nothing needs checking at the next checkout.
    pub params_synced_for: Option<(u64, u64)>,
    /// Statements prepared on this connection under pgmemo's names.
    pub prepared: crate::statements::ServerSet,
    /// The ParameterDescription of a Describe of a statement, kept until its RowDescription or
    /// NoData completes the description (see `idle_batch::observe_description`).
    pub describing: BytesMut,
    /// Set when the connection must not go back to the pool (I/O error, protocol confusion,
    /// FATAL from the server).
    pub broken: bool,
    /// A poll of its socket for a read returned Pending: the first read after the wake-up
    /// that follows goes without another poll (see `Stream::try_read_buf_socket`); later
    /// ones are polled, and so spend the task's cooperative budget.
    pub read_armed: bool,
    /// The worker whose event loop its socket is registered with (see workers.rs).
    pub worker: u16,
}

impl ServerConn {
    /// A connection over an open stream, before login: what [`ServerConn::connect`] logs in
    /// with. Public for benches/hot_path.rs, which hands a session a connection over a
    /// loopback socket that no server is behind (it never writes to it).
    #[doc(hidden)]
    pub fn over(stream: Stream) -> io::Result<ServerConn> {
        let now = Moment::now();
        let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
        let (addr, local_addr) = match &stream {
            Stream::Unix(_) => (unspecified, unspecified),
            _ => (stream.peer_addr()?, stream.local_addr()?),
        };
        Ok(ServerConn {
            rbuf: BytesMut::with_capacity(16 * 1024),
            wbuf: BytesMut::with_capacity(16 * 1024),
            info: Arc::new(ServerInfo {
                id: NEXT_SERVER_ID.fetch_add(1, Ordering::Relaxed),
                addr,
                local_addr,
                backend_pid: 0,
                unix_socket: None,
                connect_time: std::time::SystemTime::now(),
                created: now,
                tls: stream.is_tls(),
                host_index: 0,
                replication: Replication::None,
                state: AtomicU8::new(ServerState::Login as u8),
                client_id: AtomicU64::new(0),
                client_pid: AtomicI32::new(0),
                prepared_statements: AtomicU64::new(0),
                prepare_cache_hit: AtomicU64::new(0),
                prepare_cache_miss: AtomicU64::new(0),
                prepare_evictions: AtomicU64::new(0),
                request_us: AtomicU64::new(0),
            }),
            stream,
            backend_secret: 0,
            reported: Vars::new(),
            reported_as: None,
            settings: Vars::new(),
            status: b'I',
            completed_since_ready: false,
            prepared: crate::statements::ServerSet::new(500),
            describing: BytesMut::new(),
            last_used: now,
            checked_out: now,
            params_synced_for: None,
            broken: false,
            read_armed: false,
            worker: crate::workers::current(),
        })
    }

    /// Makes the calling thread's worker serve this connection from now on: the pool hands
    /// it to a session on another worker than the one it last served. Without it every
    /// message would be read on one thread and handled on another. Returns whether it moved.
    #[inline]
    pub fn move_here(&mut self) -> bool {
        let here = crate::workers::current();
        self.worker != here && self.move_to(here)
    }

    /// [`ServerConn::move_here`]'s move, out of line: with one worker it never runs.
    #[cold]
    #[inline(never)]
    fn move_to(&mut self, here: u16) -> bool {
        match self.stream.move_to_this_thread() {
            Ok(()) => {
                self.worker = here;
                true
            }
            // Still usable where it is, at the price of a wake-up of the other thread for
            // every message.
            Err(e) => {
                tracing::debug!(error = %e, "a server connection stays on its worker");
                false
            }
        }
    }

    /// Connects and logs in. The returned connection is idle ('I') with its reported
    /// parameters known.
    pub async fn connect(target: &ServerTarget) -> Result<ServerConn, ServerError> {
        Self::connect_with(target, &[]).await
    }

    /// [`ServerConn::connect`] with more startup parameters (`replication=database`).
    ///
    /// The target's hosts are tried in order, as libpq does: the first that accepts a
    /// connection and a login (and is what `target_session_attrs` asks for; with
    /// `prefer-standby`, a second pass takes any) is used; when none does, the last host's
    /// error is returned. The primary's host is noted (see [`crate::primary`]).
    pub async fn connect_with(
        target: &ServerTarget,
        extra: &[(&str, &str)],
    ) -> Result<ServerConn, ServerError> {
        let attrs = target.session_attrs;
        let mut last = None;
        let passes = if attrs == SessionAttrs::PreferStandby {
            2
        } else {
            1
        };
        let mut tries = Vec::with_capacity(passes * (1 + target.fallbacks.len()));
        for pass in 0..passes {
            tries.extend(
                target
                    .hosts()
                    .map(|(index, host, port)| (pass, index, host, port)),
            );
        }
        for (pass, index, host, port) in tries {
            let attempt = Self::connect_host(target, host, port, extra);
            let result = match target.connect_timeout {
                None => attempt.await,
                Some(limit) => crate::timer::timeout(limit, attempt)
                    .await
                    .unwrap_or_else(|_| {
                        Err(ServerError::Io(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("{}: timeout expired", describe_host(host, port)),
                        )))
                    }),
            };
            match result {
                Ok(mut conn)
                    if attrs.accepts(conn.is_standby(), conn.is_read_only(), pass == 1) =>
                {
                    Arc::get_mut(&mut conn.info)
                        .expect("a new connection's info is not shared yet")
                        .host_index = index;
                    if attrs.wants_primary() && target.primary.found_at(index) {
                        tracing::warn!(
                            host,
                            port,
                            database = %target.database_id,
                            "the primary moved here (a switchover or failover): servers of \
                             the old one are closed, the WAL stream starts again here"
                        );
                    }
                    return Ok(conn);
                }
                Ok(conn) => {
                    let why = match attrs {
                        SessionAttrs::ReadWrite => "session is read-only",
                        SessionAttrs::ReadOnly => "session is not read-only",
                        SessionAttrs::Primary => "server is in hot standby mode",
                        _ => "server is not in hot standby mode",
                    };
                    tracing::info!(host, port, "{why}; trying the next host");
                    conn.terminate().await;
                    last = Some(ServerError::Protocol(format!(
                        "{}: {why} (target_session_attrs={})",
                        describe_host(host, port),
                        attrs.as_str()
                    )));
                }
                Err(e) => {
                    if target.fallbacks.is_empty() {
                        return Err(e);
                    }
                    tracing::info!(host, port, error = %e, "server unusable; trying the next host");
                    last = Some(e);
                }
            }
        }
        Err(last.expect("a target has at least one host"))
    }

    /// Connects to one host of `target` (a Unix socket directory or a TCP host) and logs in.
    async fn connect_host(
        target: &ServerTarget,
        host: &str,
        port: u16,
        extra: &[(&str, &str)],
    ) -> Result<ServerConn, ServerError> {
        let failed = |e: io::Error| {
            ServerError::Io(io::Error::new(
                e.kind(),
                format!("{} failed: {e}", describe_host(host, port)),
            ))
        };
        if is_socket_dir(host) {
            // No TLS over a Unix socket, whatever the mode: libpq does not ask for it either.
            let path = socket_path(host, port);
            let unix = tokio::net::UnixStream::connect(&path)
                .await
                .map_err(failed)?;
            let mut conn = ServerConn::over(Stream::Unix(Box::new(unix)))?;
            Arc::get_mut(&mut conn.info)
                .expect("a new connection's info is not shared yet")
                .unix_socket = Some(Arc::new(path));
            conn.login(target, extra).await?;
            return Ok(conn);
        }
        let tcp = TcpStream::connect((host, port)).await.map_err(failed)?;
        tcp.set_nodelay(true)?;
        crate::keepalive::apply(&tcp, &target.keepalive)?;
        let stream = match (&target.tls, target.tls_mode) {
            (Some(connector), mode) if mode != ServerTlsMode::Disable => {
                let s = crate::tls::connect_server_tls(tcp, connector, host).await?;
                if !s.is_tls() && mode != ServerTlsMode::Prefer {
                    return Err(ServerError::Protocol(format!(
                        "server {}:{} does not support TLS but server_tls (or the sslmode of its connection string) is {:?}",
                        host, port, mode
                    )));
                }
                s
            }
            _ => Stream::Tcp(tcp),
        };
        let mut conn = ServerConn::over(stream)?;
        conn.login(target, extra).await?;
        Ok(conn)
    }

    /// The server's reported parameters, as of the last ParameterStatus for each.
    #[inline]
    pub fn reported(&self) -> &Vars {
        &self.reported
    }

    /// A ReadyForQuery: the transaction status it reports.
    #[inline]
    pub fn set_ready(&mut self, status: u8) {
        self.status = status;
        self.completed_since_ready = false;
    }

    /// Whether the server is in an aborted transaction block as far as its replies so far
    /// tell: the last ReadyForQuery said so and nothing completed since.
    #[inline]
    pub fn aborted(&self) -> bool {
        self.status == b'E' && !self.completed_since_ready
    }

    /// A ParameterStatus: the server's `name` is now `value`.
    pub fn set_reported(&mut self, name: &str, value: &str) {
        self.reported.set(name, value);
        self.reported_as = None;
    }

    /// [`ServerConn::set_reported`] for the ParameterStatus message that starts `rbuf`
    /// (`len` bytes).
    pub fn note_parameter_status(&mut self, len: usize) {
        let body = crate::protocol::body(&self.rbuf[..len]);
        if let Some((name, value)) = backend::parse_parameter_status(body) {
            self.reported.set(name, value);
            self.reported_as = None;
        }
    }

    /// Whether the server's reported parameters are `client`'s (a client's shared copy):
    /// compared once per copy while they stay the same (see `reported_as`).
    #[inline]
    pub fn reports_as(&mut self, client: &Arc<Vars>) -> bool {
        if self
            .reported_as
            .as_ref()
            .is_some_and(|known| Arc::ptr_eq(known, client))
        {
            return true;
        }
        let same = self.reported == **client;
        self.reported_as = same.then(|| client.clone());
        same
    }

    /// Whether the server is a standby, from what it reported (PostgreSQL 14 and later report
    /// `in_hot_standby` at login and when it changes, which is what libpq reads for
    /// `target_session_attrs`).
    pub fn is_standby(&self) -> bool {
        self.reported.is("in_hot_standby", "on")
    }

    /// Whether the server refuses writes: a standby, or `default_transaction_read_only` on
    /// (reported too).
    pub fn is_read_only(&self) -> bool {
        self.is_standby() || self.reported.is("default_transaction_read_only", "on")
    }

    /// Queues the StartupMessage: the target's user, database and application_name, then
    /// `extra` (a replication connection's kind is noted for SHOW SERVERS).
    fn send_startup(&mut self, target: &ServerTarget, extra: &[(&str, &str)]) {
        let mut params = vec![
            ("user", target.user.as_str()),
            ("database", target.dbname.as_str()),
        ];
        if let Some(name) = &target.application_name {
            params.push(("application_name", name.as_str()));
        }
        params.extend_from_slice(extra);
        if let Some((_, kind)) = extra.iter().find(|(k, _)| *k == "replication") {
            Arc::get_mut(&mut self.info)
                .expect("a new connection's info is not shared yet")
                .replication = Replication::parse(kind).unwrap_or_default();
        }
        frontend::startup(&mut self.wbuf, &params);
    }

    async fn login(
        &mut self,
        target: &ServerTarget,
        extra: &[(&str, &str)],
    ) -> Result<(), ServerError> {
        self.send_startup(target, extra);
        self.flush().await?;
        let password = target.password.as_deref().unwrap_or("");
        let mut scram: Option<crate::auth::ScramClient> = None;
        let mut pid = 0;
        loop {
            let (tag, body) = self.read_message().await?;
            match tag {
                backend::AUTHENTICATION => {
                    let req = backend::parse_auth(&body).ok_or_else(|| {
                        ServerError::Protocol("malformed authentication request".into())
                    })?;
                    match req {
                        AuthRequest::Ok => {}
                        AuthRequest::Cleartext | AuthRequest::Md5(_)
                            if target.password.is_none() =>
                        {
                            return Err(no_password(target));
                        }
                        AuthRequest::Sasl(_)
                            if target.password.is_none() && target.scram_keys.is_none() =>
                        {
                            return Err(no_password(target));
                        }
                        AuthRequest::Cleartext => {
                            frontend::password(&mut self.wbuf, password.as_bytes());
                        }
                        AuthRequest::Md5(salt) => {
                            // An md5 hash as the password is PostgreSQL's stored secret:
                            // answer from it (md5 pass-through, as PgBouncer does).
                            let hash = crate::auth::md5_response_for(&target.user, password, salt);
                            frontend::password(&mut self.wbuf, hash.as_bytes());
                        }
                        AuthRequest::Sasl(mechs) => {
                            if !mechs.contains(&"SCRAM-SHA-256") {
                                return Err(ServerError::Protocol(format!(
                                    "server offers no supported SASL mechanism: {mechs:?}"
                                )));
                            }
                            let client = match (&target.password, &target.scram_keys) {
                                (None, Some(keys)) => {
                                    crate::auth::ScramClient::with_keys(keys.clone())
                                }
                                _ => crate::auth::ScramClient::new(password.as_bytes()),
                            };
                            frontend::sasl_initial_response(
                                &mut self.wbuf,
                                "SCRAM-SHA-256",
                                client.client_first(),
                            );
                            scram = Some(client);
                        }
                        AuthRequest::SaslContinue(data) => {
                            let client = scram.as_mut().ok_or_else(|| {
                                ServerError::Protocol("SASL continue without SASL start".into())
                            })?;
                            let reply = client
                                .handle_server_first(data)
                                .map_err(|e| ServerError::Protocol(e.to_string()))?;
                            frontend::sasl_response(&mut self.wbuf, &reply);
                        }
                        AuthRequest::SaslFinal(data) => {
                            let client = scram.as_mut().ok_or_else(|| {
                                ServerError::Protocol("SASL final without SASL start".into())
                            })?;
                            client
                                .handle_server_final(data)
                                .map_err(|e| ServerError::Protocol(e.to_string()))?;
                        }
                        AuthRequest::Other(n) => {
                            return Err(ServerError::Protocol(format!(
                                "server asks for unsupported authentication method {n}"
                            )))
                        }
                    }
                    self.flush().await?;
                }
                backend::PARAMETER_STATUS => {
                    if let Some((k, v)) = backend::parse_parameter_status(&body) {
                        self.set_reported(k, v);
                    }
                }
                backend::BACKEND_KEY_DATA => {
                    if let Some((p, secret)) = backend::parse_backend_key_data(&body) {
                        pid = p;
                        self.backend_secret = secret;
                    }
                }
                backend::ERROR_RESPONSE => return Err(server_error(body)),
                backend::NOTICE_RESPONSE | backend::NEGOTIATE_PROTOCOL_VERSION => {}
                backend::READY_FOR_QUERY => {
                    self.set_ready(body.first().copied().unwrap_or(b'I'));
                    break;
                }
                other => {
                    return Err(ServerError::Protocol(format!(
                        "unexpected message {:?} during server login",
                        other as char
                    )))
                }
            }
        }
        let info = Arc::get_mut(&mut self.info).expect("info not shared during login");
        info.backend_pid = pid;
        self.set_state(ServerState::Idle);
        Ok(())
    }

    pub fn set_state(&self, state: ServerState) {
        self.info.state.store(state as u8, Ordering::Relaxed);
    }

    pub async fn flush(&mut self) -> io::Result<()> {
        if !self.wbuf.is_empty() {
            self.stream.write_all(&self.wbuf).await?;
            self.wbuf.clear();
        }
        self.stream.flush().await
    }

    /// Reads one whole message (off the hot path: login and internal queries).
    pub async fn read_message(&mut self) -> Result<(u8, Bytes), ServerError> {
        loop {
            if let Some((tag, len)) = frame(&self.rbuf, MAX_BACKEND_MESSAGE_SIZE)
                .map_err(|e| ServerError::Protocol(e.to_string()))?
            {
                let mut msg = self.rbuf.split_to(len);
                msg.advance(5);
                return Ok((tag, msg.freeze()));
            }
            self.rbuf.reserve(8192);
            if self.stream.read_buf(&mut self.rbuf).await? == 0 {
                return Err(ServerError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "server closed the connection",
                )));
            }
        }
    }

    /// Runs `sql` as a simple query on an idle server and returns its rows as text. Parameter
    /// changes it causes are recorded; the first error is returned after ReadyForQuery, so the
    /// connection stays usable.
    pub async fn internal_query(
        &mut self,
        sql: &str,
    ) -> Result<Vec<Vec<Option<String>>>, ServerError> {
        self.internal_query_relaying(sql, None).await
    }

    /// [`ServerConn::internal_query`] on a server held by a client: the NotificationResponse
    /// messages that arrive meanwhile are the client's, and are appended whole to
    /// `notifications` instead of being dropped.
    pub async fn internal_query_relaying(
        &mut self,
        sql: &str,
        notifications: Option<&mut bytes::BytesMut>,
    ) -> Result<Vec<Vec<Option<String>>>, ServerError> {
        frontend::query(&mut self.wbuf, sql);
        self.internal_reply(notifications).await
    }

    /// [`ServerConn::internal_query`] with `params` bound as text (extended protocol), for
    /// values that must not be spliced into the SQL text (a client's user name).
    pub async fn internal_query_with_params(
        &mut self,
        sql: &str,
        params: &[&str],
    ) -> Result<Vec<Vec<Option<String>>>, ServerError> {
        frontend::query_with_params(&mut self.wbuf, sql, params);
        self.internal_reply(None).await
    }

    /// Sends what was written for an internal query and reads its reply up to ReadyForQuery:
    /// the rows as text, or the first error.
    async fn internal_reply(
        &mut self,
        mut notifications: Option<&mut bytes::BytesMut>,
    ) -> Result<Vec<Vec<Option<String>>>, ServerError> {
        // It may change the session's parameters behind the last client's back.
        self.params_synced_for = None;
        self.flush().await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let (tag, body) = match self.read_message().await {
                Ok(m) => m,
                Err(e) => {
                    self.broken = true;
                    return Err(e);
                }
            };
            match tag {
                backend::DATA_ROW => rows.push(parse_text_row(&body)),
                backend::NOTIFICATION_RESPONSE => {
                    if let Some(out) = notifications.as_deref_mut() {
                        crate::protocol::write_message(out, tag, |b| b.extend_from_slice(&body));
                    }
                }
                backend::PARAMETER_STATUS => {
                    if let Some((k, v)) = backend::parse_parameter_status(&body) {
                        self.set_reported(k, v);
                    }
                }
                backend::ERROR_RESPONSE => {
                    let e = server_error(body);
                    if let ServerError::Server { fields, .. } = &e {
                        if fields.is_fatal() {
                            self.broken = true;
                            return Err(e);
                        }
                    }
                    error.get_or_insert(e);
                }
                backend::READY_FOR_QUERY => {
                    self.set_ready(body.first().copied().unwrap_or(b'I'));
                    break;
                }
                backend::COPY_IN_RESPONSE
                | backend::COPY_OUT_RESPONSE
                | backend::COPY_BOTH_RESPONSE => {
                    // Never issued by pgmemo's own queries; a server in this state is unusable.
                    self.broken = true;
                    return Err(ServerError::Protocol(
                        "unexpected COPY in internal query".into(),
                    ));
                }
                _ => {}
            }
        }
        self.last_used = Moment::now();
        match error {
            Some(e) => Err(e),
            None => Ok(rows),
        }
    }

    /// The server's major version (15, 18...), read from its `server_version` report (which
    /// may carry a suffix: "15.18 (Debian 15.18-0+deb12u1)", "18beta1"); None if it sent none.
    pub fn major_version(&self) -> Option<u32> {
        let version = self.reported().get("server_version")?;
        let digits = version.bytes().take_while(u8::is_ascii_digit).count();
        version[..digits].parse().ok()
    }

    /// Cheap check that an idle connection was not closed by the server meanwhile (restart,
    /// idle_session_timeout, pg_terminate_backend). Uses the reactor's cached readiness, so when
    /// nothing arrived it costs no system call.
    pub fn looks_alive(&self) -> bool {
        // Nothing seen since the last read: alive, without building the error a socket read
        // would return (a pool checkout, under the pool's lock).
        if !self.stream.seen_readable() {
            return true;
        }
        let mut byte = [0u8; 1];
        match self.stream.try_read_socket(&mut byte) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => true,
            // EOF, or an unsolicited message (a FATAL) on an idle connection: either way it is
            // not safe to hand out.
            _ => false,
        }
    }

    /// Politely ends the connection.
    pub async fn terminate(mut self) {
        frontend::terminate(&mut self.wbuf);
        let _ = crate::timer::timeout(Duration::from_secs(1), self.flush()).await;
        let _ = crate::timer::timeout(Duration::from_secs(1), self.stream.shutdown()).await;
    }

    /// Ends the connection as [`ServerConn::terminate`] does, then waits, at most `within`,
    /// until the server has closed its end: a backend closes its socket last as it exits,
    /// after it has left its database and dropped its temporary replication slot, so that a
    /// statement that needs the database to itself (`DROP DATABASE`, see [`crate::vacate`])
    /// finds it gone. Whatever was left half sent is dropped: a message cut short makes the
    /// server end the connection all the same, as the end of pgmemo's side does.
    pub async fn terminate_and_wait(mut self, within: Duration) {
        self.wbuf.clear();
        self.finish_and_wait(within).await;
    }

    /// Ends the connection after what is still to be sent (the work of a client gone, which
    /// its own backend would have run before reading its Terminate), then waits as
    /// [`ServerConn::terminate_and_wait`] does: once the server's end is closed, the
    /// backend has ended its transaction.
    pub async fn finish_and_wait(mut self, within: Duration) {
        frontend::terminate(&mut self.wbuf);
        let _ = crate::timer::timeout(within, async {
            if self.flush().await.is_err() {
                return;
            }
            let _ = self.stream.shutdown().await;
            loop {
                self.rbuf.clear();
                self.rbuf.reserve(512);
                match self.stream.read_buf(&mut self.rbuf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
    }
}

/// The port in a socket file's name (`.s.PGSQL.5432`), for SHOW SERVERS.
pub fn socket_port(path: &std::path::Path) -> Option<u16> {
    path.file_name()?
        .to_str()?
        .strip_prefix(".s.PGSQL.")?
        .parse()
        .ok()
}

/// A server host as libpq names it in its connection errors.
fn describe_host(host: &str, port: u16) -> String {
    if is_socket_dir(host) {
        format!(
            "connection to server on socket \"{}\"",
            socket_path(host, port).display()
        )
    } else {
        format!("connection to server at \"{host}\", port {port}")
    }
}

/// The server asks for a password and pgmemo has none for the role (a client's own role
/// whose password pgmemo was never given nor learnt from its login, or a fixed user without
/// one): a FATAL 28P01 as if from the server, shown to the client as PostgreSQL's refusals
/// are, so the login fails; never retried with another role, and no empty password is
/// sent. PgBouncer sends an empty one and passes on the server's "password authentication
/// failed", which names the wrong culprit: the client's own password was right.
fn no_password(target: &ServerTarget) -> ServerError {
    let user = &target.user;
    let message = match target.scram_keys {
        Some(_) => format!(
            "pgmemo has no password to log into the server as \"{user}\" (the server asks \
             for a password or md5, and pgmemo holds only the SCRAM keys of the client's login)"
        ),
        None => format!("pgmemo has no password to log into the server as \"{user}\""),
    };
    let hint = format!(
        "Give \"{user}\" its password in [users] or general.auth_file (or its SCRAM \
         verifier or md5 hash, for pass-through with auth_type scram-sha-256 or md5), or set \
         user = \"...\" in the database's [databases] entry to log in as one fixed role."
    );
    let raw = backend::error_body(&[
        (b'S', "FATAL"),
        (b'V', "FATAL"),
        (b'C', backend::sqlstate::INVALID_PASSWORD),
        (b'M', &message),
        (b'H', &hint),
    ]);
    server_error(raw)
}

pub fn server_error(body: Bytes) -> ServerError {
    let fields = ErrorFields::parse(&body).unwrap_or_default();
    ServerError::Server { fields, raw: body }
}

/// A DataRow's columns as text (None for NULL).
pub fn parse_text_row(body: &[u8]) -> Vec<Option<String>> {
    let mut r = crate::protocol::Reader::new(body);
    let n = r.i16().unwrap_or(0).max(0);
    (0..n)
        .map(|_| {
            let len = r.i32()?;
            if len < 0 {
                return None;
            }
            r.bytes(len as usize)
                .map(|b| String::from_utf8_lossy(b).into_owned())
        })
        .collect()
}

/// Sends a CancelRequest for (pid, secret) to a server at `addr`, as PostgreSQL expects it: on
/// a new connection, unencrypted, with no reply. Returns once the server has closed that
/// connection (or after five seconds at each step): its postmaster has then sent both of its
/// signals (to the backend, then to its process group), so nothing sent to the backend from
/// then on can be cancelled by this request (see [`crate::cancel`]).
/// A server reached over a Unix socket is sent it there.
pub async fn send_cancel(addr: &CancelAddr, pid: i32, secret: i32) -> io::Result<()> {
    let connect = async {
        Ok::<_, io::Error>(match addr {
            CancelAddr::Unix(path) => {
                Stream::Unix(Box::new(tokio::net::UnixStream::connect(&**path).await?))
            }
            CancelAddr::Tcp(addr) => Stream::Tcp(TcpStream::connect(addr).await?),
        })
    };
    let mut tcp = crate::timer::timeout(Duration::from_secs(5), connect)
        .await
        .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
    let mut msg = [0u8; 16];
    msg[0..4].copy_from_slice(&16u32.to_be_bytes());
    msg[4..8].copy_from_slice(&crate::protocol::startup::CANCEL_REQUEST.to_be_bytes());
    msg[8..12].copy_from_slice(&pid.to_be_bytes());
    msg[12..16].copy_from_slice(&secret.to_be_bytes());
    tcp.write_all(&msg).await?;
    // The server closes the connection when done; waiting for that keeps the cancel ordered
    // before whatever the caller does next.
    let mut sink = [0u8; 1];
    let _ = crate::timer::timeout(Duration::from_secs(5), tcp.read(&mut sink)).await;
    Ok(())
}
