//! A client's way in: the startup packet (and the SSL/GSS/cancel requests that may precede or
//! replace it), authentication, and the parameters it is told about before its first query.

use super::ClientConn;
use crate::app::{App, Endpoint, Passthrough};
use crate::auth::{md5_salt, md5_verify, AuthError, ScramServer, Secret};
use crate::config::AuthType;
use crate::protocol::backend::{self as be, sqlstate, Severity};
use crate::protocol::startup::{self, Replication, StartupError, StartupPacket};
use crate::protocol::{frame, frontend as fe};
use crate::stats::LoginFailure;
use crate::stream::Stream;
use bytes::{Buf, Bytes, BytesMut};
use std::io;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A client that logged in and may stay, with its addresses.
pub struct Admitted {
    pub startup: Startup,
    pub peer: Endpoint,
    pub local: Endpoint,
}

/// The setting whose limit one more client of `startup`'s database or user would pass
/// (`max_db_client_connections`, then `max_user_client_connections`, PgBouncer's order);
/// None when it may stay. The admin console is not counted.
fn client_limit_reached(app: &App, startup: &Startup) -> Option<&'static str> {
    use crate::budget::BudgetOf;
    if crate::config::is_admin_database(&startup.database) {
        return None;
    }
    let (database, user) = app
        .config
        .load()
        .client_limits(&startup.database, &startup.user);
    if database > 0 && app.clients_of(BudgetOf::Database, &startup.database) >= database {
        return Some("max_db_client_connections");
    }
    if user > 0 && app.clients_of(BudgetOf::User, &startup.user) >= user {
        return Some("max_user_client_connections");
    }
    None
}

/// Logs a client in within client_login_timeout and checks it may stay (not shutting down,
/// under max_client_conn): its startup and addresses, or None when it was turned away.
pub async fn admit(app: &App, client: Stream) -> Option<Box<Admitted>> {
    let (peer, local) = addresses(app, &client)?;
    let login_timeout = app.config.load().general.client_login_timeout;
    let login = read_startup(app, client);
    let mut startup = match crate::timer::timeout(login_timeout, login).await {
        Err(_) => {
            tracing::info!(%peer, "client did not finish its login within client_login_timeout");
            app.errors.login_failed(LoginFailure::Timeout);
            return None;
        }
        Ok(Err(LoginError::Io(e))) => {
            tracing::debug!(%peer, error = %e, "client went away during login");
            return None;
        }
        Ok(Err(LoginError::Dropped(why))) => {
            tracing::info!(%peer, error = %why, "client startup packet refused without a reply");
            app.errors.login_failed(LoginFailure::Protocol);
            return None;
        }
        Ok(Err(e)) => {
            tracing::info!(%peer, error = %e, "client login refused");
            if let LoginError::Refused { code, .. } = e {
                app.errors.login_failed(LoginFailure::of_code(code));
            }
            return None;
        }
        Ok(Ok(Outcome::Done)) => return None,
        Ok(Ok(Outcome::Session(s))) => *s,
    };
    let max_clients = app.config.load().general.max_client_conn as usize;
    // During an online restart a client that reached this process still logs in here (the
    // process is not shutting down): it is handed over at its first rest.
    if app.is_shutting_down() {
        app.errors.login_failed(LoginFailure::ShuttingDown);
        startup
            .conn
            .send_error(
                Severity::Fatal,
                sqlstate::CANNOT_CONNECT_NOW,
                "the database system is shutting down",
            )
            .await;
        return None;
    }
    if app.client_count() >= max_clients {
        tracing::warn!(%peer, "max_client_conn reached, refusing client");
        app.errors
            .max_client_conn
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        startup
            .conn
            .send_error(
                Severity::Fatal,
                sqlstate::TOO_MANY_CONNECTIONS,
                "no more connections allowed (max_client_conn)",
            )
            .await;
        return None;
    }
    if let Some(setting) = client_limit_reached(app, &startup) {
        tracing::warn!(%peer, database = %startup.database, user = %startup.user, "{setting} reached, refusing client");
        app.errors.login_failed(LoginFailure::Other);
        let message = format!("client connections exceeded ({setting})");
        startup
            .conn
            .send_error(Severity::Fatal, sqlstate::PROTOCOL_VIOLATION, &message)
            .await;
        return None;
    }
    Some(Box::new(Admitted {
        startup,
        peer,
        local,
    }))
}

/// A client's endpoints, as SHOW CLIENTS shows them: on the Unix socket `unix` and the listen
/// port both, as PgBouncer shows them. Sets TCP_NODELAY on a TCP client.
pub(super) fn addresses(app: &App, client: &Stream) -> Option<(Endpoint, Endpoint)> {
    match client.tcp() {
        Some(tcp) => {
            let _ = tcp.set_nodelay(true);
            Some((tcp.peer_addr().ok()?.into(), tcp.local_addr().ok()?.into()))
        }
        None => {
            let port = app.listen_addr.lock().map_or(0, |a| a.port());
            Some((Endpoint::unix(port), Endpoint::unix(port)))
        }
    }
}

/// A client that sent a valid StartupMessage.
pub struct Startup {
    pub conn: ClientConn,
    pub user: String,
    pub database: String,
    /// Startup parameters other than user/database, `options` already split into settings.
    pub params: Vec<(String, String)>,
    /// A replication connection (`replication` = `database` or true) is relayed to a server
    /// of its own (see [`super::replication`]).
    pub replication: Replication,
}

/// How the startup phase ended without a session.
pub enum Outcome {
    Session(Box<Startup>),
    /// A CancelRequest (handled) or a client that went away: nothing more to do.
    Done,
}

/// Why a login failed; the message has already been sent to the client when there is one.
#[derive(Debug, thiserror::Error)]
pub enum LoginError {
    #[error("{0}")]
    Io(#[from] io::Error),
    /// A malformed or truncated startup packet, closed without a reply as PostgreSQL closes
    /// it (it only logs it): the reason, in PostgreSQL's log words.
    #[error("{0}")]
    Dropped(String),
    #[error("{code}: {message}")]
    Refused { code: &'static str, message: String },
}

impl LoginError {
    pub fn refused(code: &'static str, message: impl Into<String>) -> LoginError {
        LoginError::Refused {
            code,
            message: message.into(),
        }
    }
}

/// Reads the startup packet, doing TLS and answering GSSENC/cancel requests on the way. A
/// client on the Unix socket is answered `N` to SSLRequest, as PostgreSQL answers there.
///
/// A malformed or truncated packet is answered as PostgreSQL's ProcessStartupPacket answers
/// it: a length out of range, a CancelRequest of the wrong length or an end of stream inside
/// a packet closes the connection without a reply ([`LoginError::Dropped`]); an unsupported
/// protocol version, a second SSLRequest or GSSENCRequest (which reads as version 1234.5679 or
/// 1234.5680), or unencrypted bytes already sent after a request gets PostgreSQL's FATAL.
pub async fn read_startup(app: &App, mut stream: Stream) -> Result<Outcome, LoginError> {
    let mut rbuf = BytesMut::with_capacity(1024);
    // Each encryption request is answered once; after TLS, neither is (PostgreSQL's ssl_done
    // and gss_done).
    let (mut ssl_done, mut gss_done) = (false, false);
    loop {
        let packet = loop {
            match startup::frame(&rbuf) {
                Ok(Some(len)) => break rbuf.split_to(len).freeze(),
                Ok(None) => {}
                Err(e) => return Err(LoginError::Dropped(e.to_string())),
            }
            if stream.read_buf(&mut rbuf).await? == 0 {
                // A client that connects and leaves (a port probe) is not worth an error.
                if rbuf.is_empty() {
                    return Ok(Outcome::Done);
                }
                return Err(LoginError::Dropped(startup::INCOMPLETE.to_owned()));
            }
        };
        let parsed = match startup::parse(&packet) {
            Ok(StartupPacket::Ssl) if ssl_done => {
                Err(StartupError::UnsupportedProtocol(startup::SSL_REQUEST))
            }
            Ok(StartupPacket::GssEnc) if gss_done => {
                Err(StartupError::UnsupportedProtocol(startup::GSSENC_REQUEST))
            }
            parsed => parsed,
        };
        match parsed {
            Ok(StartupPacket::Ssl) => {
                let acceptor = app.tls_acceptor.load_full();
                match (&stream, acceptor) {
                    (Stream::Tcp(_), Some(acceptor)) => {
                        if !rbuf.is_empty() {
                            // Bytes sent after SSLRequest but before our answer would bypass
                            // encryption (CVE-2021-23214): refuse them, in PostgreSQL's words,
                            // before TLS starts.
                            return Err(unencrypted(&mut stream, "SSL request").await);
                        }
                        stream.write_all(b"S").await?;
                        let Stream::Tcp(tcp) = stream else {
                            unreachable!()
                        };
                        let tls = acceptor.accept(tcp).await?;
                        stream = Stream::ServerTls(Box::new(tls));
                        gss_done = true;
                    }
                    _ => {
                        stream.write_all(b"N").await?;
                        if !rbuf.is_empty() {
                            return Err(unencrypted(&mut stream, "SSL request").await);
                        }
                    }
                }
                ssl_done = true;
            }
            Ok(StartupPacket::GssEnc) => {
                // Declined, as by a PostgreSQL built without GSSAPI.
                stream.write_all(b"N").await?;
                if !rbuf.is_empty() {
                    let request = "GSSAPI encryption request";
                    return Err(unencrypted(&mut stream, request).await);
                }
                gss_done = true;
            }
            Ok(StartupPacket::Cancel { pid, secret }) => {
                app.cancel(pid, secret).await;
                return Ok(Outcome::Done);
            }
            Ok(StartupPacket::Startup {
                minor,
                params,
                well_formed,
            }) => {
                let mut conn = ClientConn::new(stream, rbuf);
                return accept_startup(app, &mut conn, minor, params, well_formed)
                    .await
                    .map(|(user, database, params, replication)| {
                        Outcome::Session(Box::new(Startup {
                            conn,
                            user,
                            database,
                            params,
                            replication,
                        }))
                    });
            }
            Err(StartupError::UnsupportedProtocol(v)) if startup::refused_in_protocol_2(v) => {
                // A client that old reads only protocol 2.0 errors: answer as PostgreSQL does.
                let message = StartupError::UnsupportedProtocol(v).to_string();
                let mut out = BytesMut::new();
                be::error_response_v2(&mut out, &message);
                let _ = stream.write_all(&out).await;
                return Err(LoginError::refused(
                    sqlstate::FEATURE_NOT_SUPPORTED,
                    message,
                ));
            }
            Err(e @ StartupError::UnsupportedProtocol(_)) => {
                let code = sqlstate::FEATURE_NOT_SUPPORTED;
                return Err(refuse_raw(&mut stream, code, &e.to_string(), None).await);
            }
            Err(e @ StartupError::Dropped(_)) => return Err(LoginError::Dropped(e.to_string())),
        }
    }
}

/// Sends a FATAL error on a connection that is not yet a [`ClientConn`] (during the startup
/// packet), with PostgreSQL's detail when it gives one; returns the matching LoginError.
async fn refuse_raw(
    stream: &mut Stream,
    code: &'static str,
    message: &str,
    detail: Option<&str>,
) -> LoginError {
    let mut out = BytesMut::new();
    be::error_response_detail(&mut out, Severity::Fatal, code, message, detail, None);
    let _ = stream.write_all(&out).await;
    LoginError::refused(code, message)
}

/// PostgreSQL's FATAL for bytes that came after an SSLRequest or GSSENCRequest (`request`
/// names it as PostgreSQL does) before its answer: they were sent in the clear.
async fn unencrypted(stream: &mut Stream, request: &str) -> LoginError {
    let message = format!("received unencrypted data after {request}");
    let detail = "This could be either a client-software bug or evidence of an attempted \
                  man-in-the-middle attack.";
    refuse_raw(stream, sqlstate::PROTOCOL_VIOLATION, &message, Some(detail)).await
}

/// The user, the database, the other parameters, and what the client asked of replication.
type Accepted = (String, String, Vec<(String, String)>, Replication);

/// Checks a StartupMessage's parameters as PostgreSQL does (in its order: a bad `replication`
/// value, then a terminator out of place (`well_formed`), then NegotiateProtocolVersion for a
/// minor version above 3.0 or `_pq_.` options, then a missing user) and authenticates.
async fn accept_startup(
    app: &App,
    conn: &mut ClientConn,
    minor: i32,
    params: Vec<(String, String)>,
    well_formed: bool,
) -> Result<Accepted, LoginError> {
    let cfg = app.config.load();
    if cfg.general.client_tls.requires_tls() && !conn.stream.is_tls() {
        return Err(conn
            .refuse(
                sqlstate::INVALID_AUTHORIZATION,
                "pgmemo accepts only TLS connections (client_tls = require)",
            )
            .await);
    }
    let mut user = None;
    let mut database = None;
    let mut options = Vec::new();
    let mut unknown_protocol_options = Vec::new();
    let mut settings = Vec::new();
    let mut replication = Replication::None;
    for (k, v) in params {
        match k.as_str() {
            "user" => user = Some(v),
            "database" => database = Some(v),
            "options" => options.extend(crate::params::parse_options(&v)),
            "replication" => match Replication::parse(&v) {
                Some(kind) => replication = kind,
                None => {
                    let (message, hint) = Replication::invalid(&v);
                    let code = sqlstate::INVALID_PARAMETER_VALUE;
                    return Err(conn.refuse_hinted(code, message, Some(hint)).await);
                }
            },
            k if k.starts_with("_pq_.") => unknown_protocol_options.push(k.to_owned()),
            _ => settings.push((k, v)),
        }
    }
    if !well_formed {
        return Err(conn
            .refuse(sqlstate::PROTOCOL_VIOLATION, startup::BAD_LAYOUT)
            .await);
    }
    // PostgreSQL applies `options` first and the other parameters after them, which matters
    // when both set one setting (and for DateStyle, whose parts combine).
    options.extend(settings);
    let mut settings = options;
    if cfg.general.application_name_add_host {
        add_host_to_application_name(&mut settings, &conn.stream);
    }
    if minor > 0 || !unknown_protocol_options.is_empty() {
        be::negotiate_protocol_version(
            &mut conn.wbuf,
            startup::PROTOCOL_3_0,
            &unknown_protocol_options,
        );
    }
    let Some(user) = user.filter(|u| !u.is_empty()) else {
        return Err(conn
            .refuse(
                sqlstate::INVALID_AUTHORIZATION,
                "no PostgreSQL user name specified in startup packet",
            )
            .await);
    };
    let database = database
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| user.clone());
    authenticate(app, conn, &user, &database, replication).await?;
    Ok((user, database, settings, replication))
}

/// `application_name_add_host`: the client's `application_name` (`app` when it gives none)
/// followed by ` - ` and its address and port, as PgBouncer writes them (`[::1]:5432` for
/// IPv6); on the Unix socket `unix`.
fn add_host_to_application_name(settings: &mut Vec<(String, String)>, stream: &Stream) {
    let details = match stream.peer_addr() {
        Ok(std::net::SocketAddr::V4(a)) => format!("{}:{}", a.ip(), a.port()),
        Ok(std::net::SocketAddr::V6(a)) => format!("[{}]:{}", a.ip(), a.port()),
        Err(_) => "unix".to_owned(),
    };
    // The last one counts, as PostgreSQL applies them in order.
    let given = settings
        .iter()
        .rev()
        .find(|(k, _)| k == "application_name")
        .map_or("app", |(_, v)| v.as_str());
    let name = format!("{given} - {details}");
    settings.retain(|(k, _)| k != "application_name");
    settings.push(("application_name".to_owned(), name));
}

/// Runs the configured authentication exchange; on success AuthenticationOk is queued.
async fn authenticate(
    app: &App,
    conn: &mut ClientConn,
    user: &str,
    database: &str,
    replication: Replication,
) -> Result<(), LoginError> {
    let cfg = app.config.load();
    let secret = match secret_of(app, user, database).await {
        Ok(secret) => secret.as_deref().map(Secret::parse),
        Err(crate::auth_query::LookupError::NoDatabase) => {
            return Err(conn
                .refuse(
                    sqlstate::INVALID_CATALOG_NAME,
                    format!("database \"{database}\" does not exist"),
                )
                .await);
        }
        Err(e) => {
            tracing::warn!(user, database, error = %e, "auth_query lookup failed");
            return Err(conn
                .refuse(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!(
                        "pgmemo could not look up the password of user \"{user}\" (auth_query \
                         failed; see pgmemo's log)"
                    ),
                )
                .await);
        }
    };
    let failed = || format!("password authentication failed for user \"{user}\"");
    // The HBA line that chose the method (0: none), for its ident map.
    let configured = match cfg.general.auth_type {
        AuthType::Hba => hba_method(&cfg.hba, &conn.stream, user, database, replication),
        method => Ok((method, 0)),
    };
    let (configured, line) = match configured {
        Ok(chosen) => chosen,
        Err(message) => return Err(conn.refuse(sqlstate::INVALID_AUTHORIZATION, message).await),
    };
    // As in PostgreSQL, md5 means SCRAM for a user whose secret is a SCRAM verifier: the
    // verifier cannot check an md5 answer, and SCRAM is the stronger method anyway.
    let method = match (configured, &secret) {
        (AuthType::Md5, Some(Secret::Scram(_))) => AuthType::ScramSha256,
        (method, _) => method,
    };
    match method {
        // Without a password to check, the name alone decides: as PostgreSQL answers a name
        // that is no role (with trust, nothing else is asked first).
        AuthType::Trust if !cfg.is_known_user(user) => {
            return Err(conn
                .refuse(
                    sqlstate::INVALID_AUTHORIZATION,
                    format!("role \"{user}\" does not exist"),
                )
                .await);
        }
        AuthType::Cert => {
            let lets_in = |name: &str| cfg.hba.lets_in(line, name, user);
            let refusal = certificate_refusal(&conn.stream, user, lets_in).or_else(|| {
                (!cfg.is_known_user(user)).then(|| format!("role \"{user}\" does not exist"))
            });
            if let Some(message) = refusal {
                return Err(conn.refuse(sqlstate::INVALID_AUTHORIZATION, message).await);
            }
        }
        AuthType::Trust | AuthType::Hba => {}
        AuthType::Md5 => {
            let salt = md5_salt();
            be::auth_md5(&mut conn.wbuf, salt);
            conn.flush().await?;
            let body = conn.read_password_message("password").await?;
            if !md5_verify(user, secret.as_ref(), salt, &body) {
                return Err(conn.refuse(sqlstate::INVALID_PASSWORD, failed()).await);
            }
            if let Some(Secret::Md5(hash)) = &secret {
                app.learn_passthrough(user, Passthrough::Md5(hash.clone()));
            }
        }
        AuthType::ScramSha256 => {
            let mut scram = ScramServer::new(user, secret.as_ref());
            be::auth_sasl(&mut conn.wbuf, ScramServer::mechanisms());
            conn.flush().await?;
            let body = conn.read_password_message("SASL").await?;
            let (mechanism, data) = match fe::parse_sasl_initial(&body) {
                Ok(parsed) => parsed,
                Err(e) => {
                    let message = match e.mechanism {
                        Some(m) if !ScramServer::mechanisms().contains(&m) => {
                            "client selected an invalid SASL authentication mechanism"
                        }
                        _ => e.message,
                    };
                    return Err(conn.refuse(sqlstate::PROTOCOL_VIOLATION, message).await);
                }
            };
            let server_first = match scram.handle_client_first(mechanism, data) {
                Ok(m) => m,
                Err(e) => return Err(scram_failure(conn, e, failed()).await),
            };
            be::auth_sasl_continue(&mut conn.wbuf, &server_first);
            conn.flush().await?;
            let body = conn.read_password_message("SASL").await?;
            match scram.handle_client_final(&body) {
                Ok(server_final) => be::auth_sasl_final(&mut conn.wbuf, &server_final),
                Err(e) => return Err(scram_failure(conn, e, failed()).await),
            }
            // Against a stored verifier, the client's keys log into the server as it.
            if let (Some(Secret::Scram(_)), Some(keys)) = (&secret, scram.keys()) {
                app.learn_passthrough(user, Passthrough::Scram(keys));
            }
        }
    }
    be::auth_ok(&mut conn.wbuf);
    Ok(())
}

/// Why certificate authentication refuses `user` on `stream` (PostgreSQL's message), or None
/// when the client's certificate (checked against `tls_ca_file` by the handshake) names it.
fn certificate_refusal(
    stream: &Stream,
    user: &str,
    lets_in: impl Fn(&str) -> bool,
) -> Option<String> {
    match crate::tls::client_certificate_name(stream) {
        Some(name) if lets_in(&name) => None,
        Some(name) => {
            tracing::info!(
                user,
                certificate = name,
                "certificate authentication: the certificate's Common Name is not the user \
                 (nor mapped to it)"
            );
            Some(format!(
                "certificate authentication failed for user \"{user}\""
            ))
        }
        None => Some("connection requires a valid client certificate".to_owned()),
    }
}

/// The method `hba`'s first matching line gives a client of `user` for `database` arriving
/// on `stream`, as one of `auth_type`'s (never `Hba`); PostgreSQL's FATAL message (28000) when
/// a line rejects it or none matches.
fn hba_method(
    hba: &crate::config::hba::Hba,
    stream: &Stream,
    user: &str,
    database: &str,
    replication: Replication,
) -> Result<(AuthType, usize), String> {
    use crate::config::hba::{Arrival, HbaMethod};
    let (arrival, host) = match stream {
        Stream::Unix(_) => (Arrival::Local, "[local]".to_owned()),
        s => {
            let addr = s.peer_addr().map(|a| a.ip()).map_err(|e| e.to_string())?;
            let tls = matches!(s, Stream::ServerTls(_));
            (Arrival::Tcp { addr, tls }, addr.to_string())
        }
    };
    let encryption = match arrival {
        Arrival::Tcp { tls: true, .. } => ", SSL encryption",
        _ => ", no encryption",
    };
    // A physical replication connection matches only lines for `replication` and is named
    // without a database, in PostgreSQL's words (a logical one is a database's).
    let physical = replication == Replication::Physical;
    let (who, what) = match physical {
        true => (
            format!("host \"{host}\", user \"{user}\"{encryption}"),
            "replication connection",
        ),
        false => (
            format!("host \"{host}\", user \"{user}\", database \"{database}\"{encryption}"),
            "connection",
        ),
    };
    let Some((method, line)) = hba.method(arrival, database, user, physical) else {
        return Err(match physical {
            true => format!("no pg_hba.conf entry for replication connection from {who}"),
            false => format!("no pg_hba.conf entry for {who}"),
        });
    };
    tracing::debug!(line, "{who}: HBA line {line} matched");
    let method = match method {
        HbaMethod::Trust => AuthType::Trust,
        HbaMethod::Md5 => AuthType::Md5,
        HbaMethod::ScramSha256 => AuthType::ScramSha256,
        HbaMethod::Reject => return Err(format!("pg_hba.conf rejects {what} for {who}")),
        HbaMethod::Cert => AuthType::Cert,
        HbaMethod::Peer => {
            // (Peer lines are local lines: the stream is the Unix socket's.)
            let os_user = match stream {
                Stream::Unix(unix) => unix.peer_cred().ok().and_then(|c| os_user_name(c.uid())),
                _ => None,
            };
            if !os_user
                .as_deref()
                .is_some_and(|os| hba.lets_in(line, os, user))
            {
                tracing::info!(
                    user,
                    os_user = os_user.as_deref().unwrap_or("(unknown)"),
                    "peer authentication: the client's operating-system user is not the user \
                     it logs in as (nor mapped to it)"
                );
                return Err(format!("Peer authentication failed for user \"{user}\""));
            }
            AuthType::Trust
        }
    };
    Ok((method, line))
}

/// The name of the operating-system user `uid` (None: no such user).
fn os_user_name(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `getpwuid_r` writes only into `pwd` and `buf` (whose length it is told) and sets
    // `found` to `&mut pwd` or null; `pw_name` then points into `buf`, read before `buf` goes.
    unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut found: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        );
        if rc != 0 || found.is_null() || pwd.pw_name.is_null() {
            return None;
        }
        std::ffi::CStr::from_ptr(pwd.pw_name)
            .to_str()
            .ok()
            .map(str::to_owned)
    }
}

/// The secret client `user` must prove: from `[users]` or the auth file, else looked up
/// with auth_query when the database's `auth_user` is set (not for the admin console).
async fn secret_of(
    app: &App,
    user: &str,
    database: &str,
) -> Result<Option<String>, crate::auth_query::LookupError> {
    let cfg = app.config.load();
    if let Some(secret) = cfg.user_secret(user) {
        return Ok(Some(secret.to_owned()));
    }
    if cfg.general.auth_type == AuthType::Trust
        || crate::config::is_admin_database(database)
        || cfg.auth_lookup(database).is_none()
    {
        return Ok(None);
    }
    // No secret can be looked up for a database pgmemo does not serve (auth_query runs in
    // it by default), and its client would be refused after any login: told so now, as
    // PostgreSQL tells it after one.
    if cfg.resolve(database, user).is_none() {
        return Err(crate::auth_query::LookupError::NoDatabase);
    }
    app.look_up_secret(database, user).await
}

async fn scram_failure(conn: &mut ClientConn, e: AuthError, failed: String) -> LoginError {
    match e {
        AuthError::WrongPassword => conn.refuse(sqlstate::INVALID_PASSWORD, failed).await,
        AuthError::Protocol(m) => conn.refuse(sqlstate::PROTOCOL_VIOLATION, m).await,
    }
}

impl ClientConn {
    /// Sends a FATAL error and returns the matching LoginError.
    pub async fn refuse(&mut self, code: &'static str, message: impl Into<String>) -> LoginError {
        self.refuse_hinted(code, message.into(), None).await
    }

    /// [`ClientConn::refuse`] with PostgreSQL's hint when it gives one.
    async fn refuse_hinted(
        &mut self,
        code: &'static str,
        message: String,
        hint: Option<&str>,
    ) -> LoginError {
        be::error_response_hint(&mut self.wbuf, Severity::Fatal, code, &message, hint);
        let _ = self.flush().await;
        LoginError::refused(code, message)
    }

    /// Reads one 'p' message during authentication; `kind` is "password" or "SASL", for
    /// PostgreSQL's error message when something else comes.
    async fn read_password_message(&mut self, kind: &str) -> Result<Bytes, LoginError> {
        let (tag, body) = self.read_message().await?;
        if tag != fe::PASSWORD {
            return Err(self
                .refuse(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("expected {kind} response, got message type {tag}"),
                )
                .await);
        }
        Ok(body)
    }

    /// Reads one whole message (login phase only; the relay loop frames in place).
    pub async fn read_message(&mut self) -> Result<(u8, Bytes), LoginError> {
        loop {
            match frame(&self.rbuf, crate::protocol::startup::MAX_STARTUP_PACKET) {
                Ok(Some((tag, len))) => {
                    let mut msg = self.rbuf.split_to(len);
                    msg.advance(5);
                    return Ok((tag, msg.freeze()));
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(self
                        .refuse(sqlstate::PROTOCOL_VIOLATION, e.to_string())
                        .await)
                }
            }
            if self.stream.read_buf(&mut self.rbuf).await? == 0 {
                return Err(LoginError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "client closed the connection during login",
                )));
            }
        }
    }
}
