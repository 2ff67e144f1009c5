//! A session moving to another pgmemo process during an online restart (see
//! [`crate::takeover`]): between transactions, the old process writes down what the client
//! believes of its session ([`Carried`]: its login, cancel key, parameters and settings, its
//! prepared statements) and sends it with the client's socket; the new process makes a
//! session of it that the client cannot tell from the old one, without a byte to the client.
//!
//! Only a session at rest moves: transaction mode, no server held, nothing owed to or unread
//! from the client but whole messages, nothing pinned, no TLS (its state lives in this
//! process's memory), nothing pgmemo could not write down exactly (a statement prepared under
//! another search_path, one a schema change made stale, a portal of a tracked statement).
//! Any other session goes on here and moves at its next rest; the old process ends what is
//! left when `shutdown_timeout` passes, as a safe shutdown does.
//!
//! Not carried, because the new process rebuilds it: the result cache's and autoprepare's
//! per-client buffers, statistics, the worker a client was on.

use super::{ClientConn, Session, Started};
use crate::app::{App, ResumedKey};
use crate::handoff::Handoff;
use crate::params::Vars;
use crate::pool::PoolMode;
use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// What a client's session is, written down for the process that takes it over.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
pub struct Carried {
    /// The socket is a Unix-domain one (else TCP).
    unix: bool,
    user: String,
    database: String,
    pid: i32,
    secret: i32,
    connect_secs: u32,
    /// The parameters the client was told (ParameterStatus), as it believes them now.
    reported: Vec<(String, String)>,
    /// Its other settings (startup packet and SETs carried between servers).
    settings: Vec<(String, String)>,
    /// Its startup packet's unreported settings, which `RESET` returns to.
    startup: Vec<(String, String)>,
    /// The custom settings its SQL set, which the state probe follows.
    custom: Vec<String>,
    /// Its statement tracking: None when the pool does not track statements.
    statements: Option<CarriedStatements>,
    /// The result cache was off for this client (a SET ROLE and the like), or it may hold
    /// temporary objects.
    cache_off: bool,
    cache_temp: bool,
    /// Bytes the client sent that were not read as messages yet.
    unread: Vec<u8>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct CarriedStatements {
    /// Protocol-level statements: name, text, parameter types (as the Parse carried them).
    named: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)>,
    /// SQL-level ones (`PREPARE name AS ...`): name, the PREPARE statement.
    sql: Vec<(String, String)>,
    /// The search_path the client SET and committed, and the one it had before.
    search_path: Option<String>,
    search_path_startup: Option<String>,
}

fn pairs(vars: &Vars) -> Vec<(String, String)> {
    vars.iter().map(|(k, v)| (k.into(), v.into())).collect()
}

fn vars(pairs: &[(String, String)]) -> Vars {
    let mut vars = Vars::new();
    for (k, v) in pairs {
        vars.set(k, v);
    }
    vars
}

impl Session {
    /// Whether this session can move to another process now (see the module's header).
    pub(super) fn can_hand_over(&self) -> bool {
        self.mode == PoolMode::Transaction
            && self.server.is_none()
            && self.replies.is_idle()
            && self.client.wbuf.is_empty()
            && !self.client.stream.is_tls()
            && self.state.pins == 0
            && !self.state.counted
            && !self.plan.waiting
            && !self.plan.replan
            && !self.plan.replanned
            && !self.plan.held_description
            && self.plan.retry.is_at_rest()
            && self.plan.cleanup.is_empty()
            && self.violation.is_none()
            && !self.copy_garbage
            && !self.kept_for_cancels
            && !self.info.cancels.pending()
            && self.kept.is_none()
            && self.cache.as_ref().is_none_or(|c| c.is_at_rest())
            && self
                .plan
                .stmts
                .as_ref()
                .is_none_or(|s| s.can_be_carried(&self.app.registry))
    }

    /// Writes the session down and takes its client's socket out of this process's event
    /// loop (the session keeps a placeholder); None, the session untouched, when that cannot
    /// be done.
    pub(super) fn hand_over(&mut self) -> Option<Handoff> {
        let state = serde_json::to_vec(&self.carried()).ok()?;
        match self.take_socket() {
            Ok(socket) => Some(Handoff { state, socket }),
            Err(e) => {
                tracing::warn!(error = %e, "cannot hand a client over");
                None
            }
        }
    }

    fn carried(&self) -> Carried {
        let statements = self.plan.stmts.as_ref().map(|s| CarriedStatements {
            named: s
                .carried_names()
                .map(|(name, statement)| {
                    (
                        name.to_vec(),
                        statement.key.query.to_vec(),
                        statement.key.param_types.to_vec(),
                    )
                })
                .collect(),
            sql: s.sql.iter().map(|(n, t)| (n.clone(), t.clone())).collect(),
            search_path: s.search_path.effective().map(Into::into),
            search_path_startup: s.search_path.startup().map(Into::into),
        });
        Carried {
            unix: self.client.stream.is_unix(),
            user: self.info.user.to_string(),
            database: self.info.database.to_string(),
            pid: self.info.pid(),
            secret: self.info.secret,
            connect_secs: self.info.connect_secs(),
            reported: pairs(&self.params.reported),
            settings: pairs(&self.params.settings),
            startup: pairs(&self.state.startup),
            custom: self
                .state
                .custom
                .as_deref()
                .map(|c| c.iter().map(|n| n.to_string()).collect())
                .unwrap_or_default(),
            statements,
            cache_off: self.cache.as_ref().is_some_and(|c| c.off),
            cache_temp: self.cache.as_ref().is_some_and(|c| c.temp),
            unread: self.client.rbuf.to_vec(),
        }
    }

    /// The client's socket, off this process's event loop (the session keeps a closed
    /// placeholder; it is dropped without a word to the client).
    fn take_socket(&mut self) -> std::io::Result<OwnedFd> {
        let placeholder = crate::stream::Stream::Unix(Box::new(placeholder_socket()?));
        match std::mem::replace(&mut self.client.stream, placeholder) {
            crate::stream::Stream::Tcp(tcp) => Ok(tcp.into_std()?.into()),
            crate::stream::Stream::Unix(unix) => Ok(unix.into_std()?.into()),
            other => {
                self.client.stream = other;
                Err(std::io::Error::other("a TLS client cannot be handed over"))
            }
        }
    }
}

/// One end of a fresh socket pair, standing in for a client socket that left.
fn placeholder_socket() -> std::io::Result<tokio::net::UnixStream> {
    let (a, _b) = tokio::net::UnixStream::pair()?;
    Ok(a)
}

/// Reads what [`Session::hand_over`] wrote (None: not a session pgmemo wrote).
pub fn read_carried(state: &[u8]) -> Option<Carried> {
    serde_json::from_slice(state).ok()
}

/// Goes on with a client another pgmemo process served until now: registers it with its own
/// cancel key, finds its pool, and makes its session as the old process had it. None when
/// its pool is gone from the configuration (the client is closed with PostgreSQL's 3D000
/// at its next message, as at a login).
pub async fn resume(app: Arc<App>, carried: Carried, socket: OwnedFd) -> Option<Started> {
    let stream = match open_socket(carried.unix, socket) {
        Ok(stream) => stream,
        Err(e) => {
            tracing::warn!(error = %e, "cannot take over a client's socket");
            return None;
        }
    };
    let endpoints = super::login::addresses(&app, &stream)?;
    let info = app.register_resumed_client(
        endpoints,
        &carried.user,
        &carried.database,
        ResumedKey {
            pid: carried.pid,
            secret: carried.secret,
            connect_secs: carried.connect_secs,
        },
    );
    let Some(pool) = app.pool(&carried.database, &carried.user) else {
        tracing::warn!(database = %carried.database, "a client taken over has no pool here (its database left the configuration)");
        app.unregister_client(&info);
        return None;
    };
    let client = ClientConn::new(stream, BytesMut::from(&carried.unread[..]));
    let mut session = Box::new(Session::new(app.clone(), info.clone(), pool, client));
    if session.mode != PoolMode::Transaction {
        tracing::warn!(client = %info.addr, "a client taken over now belongs to a session-mode pool: closed");
        app.unregister_client(&info);
        return None;
    }
    session.params.reported = session
        .pool
        .share_reported(Arc::new(vars(&carried.reported)));
    session.params.settings = vars(&carried.settings);
    session.state.startup = vars(&carried.startup);
    if !carried.custom.is_empty() {
        session.state.custom = Some(Box::new(
            carried.custom.iter().map(|n| n.as_str().into()).collect(),
        ));
    }
    session.track_statements();
    if let (Some(stmts), Some(carried)) = (session.plan.stmts.as_mut(), carried.statements) {
        stmts.restore_carried(
            &app.registry,
            carried.search_path.as_deref(),
            carried.search_path_startup.as_deref(),
            carried.sql,
            carried
                .named
                .into_iter()
                .map(|(n, q, t)| (Bytes::from(n), Bytes::from(q), Bytes::from(t))),
        );
    }
    if carried.cache_off || carried.cache_temp {
        let cache = session.client_cache_now();
        cache.off |= carried.cache_off;
        cache.temp |= carried.cache_temp;
    }
    if session.state.enabled && session.pool.setting_functions_unread() {
        if let Err(e) = Box::pin(session.read_setting_functions_at_login()).await {
            tracing::info!(error = %e, "no server for a client taken over");
            session.finish().await;
            app.unregister_client(&info);
            return None;
        }
    }
    session.state.setting_functions = session.pool.setting_functions().clone();
    if let Some(name) = session.params.reported.get("application_name") {
        *info.application_name.lock() = app.intern(name);
    }
    info.set_state(crate::app::ClientState::Idle);
    Some(Started { info, session })
}

/// A socket received from the old process (or given back), on this thread's event loop.
pub(super) fn open_socket(unix: bool, socket: OwnedFd) -> std::io::Result<crate::stream::Stream> {
    Ok(if unix {
        let std = std::os::unix::net::UnixStream::from(socket);
        std.set_nonblocking(true)?;
        crate::stream::Stream::Unix(Box::new(tokio::net::UnixStream::from_std(std)?))
    } else {
        let std = std::net::TcpStream::from(socket);
        std.set_nonblocking(true)?;
        crate::stream::Stream::Tcp(tokio::net::TcpStream::from_std(std)?)
    })
}
