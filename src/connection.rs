//! An accepted connection, from its first byte to the room that serves it: the client logs in
//! ([`session::login::admit`]: TLS, the startup packet, authentication, the limits on
//! clients), then the admin console serves it when it asked for the `pgmemo` database, a
//! replication relay ([`session::replication`]) a replication connection, and a session
//! ([`session::start`], [`session::serve`]) otherwise.
//!
//! This is the one place that knows both: the session does not know the admin console, and
//! the workers' event loops ([`crate::workers`]) are handed [`serve_client`] by the accept
//! loop rather than reaching up for it.

use crate::app::App;
use crate::protocol::backend::{sqlstate, Severity};
use crate::protocol::startup::Replication;
use crate::session::{self, login::Admitted, Started};
use crate::stream::Stream;
use std::sync::Arc;

/// Entry point for an accepted connection, TCP or Unix socket (a plain [`Stream`]).
///
/// Everything that runs once per client (the login, the admin console, the session's start)
/// runs in one boxed future, freed when it is done: the task's own future lives as long as
/// the client, and stays small by holding only the relay loop's state (memory per idle
/// client; `Pool::checkout` boxes its slow path for the same reason).
pub fn serve_client(app: Arc<App>, client: Stream) -> impl std::future::Future<Output = ()> + Send {
    // Boxed before the task's future is made: an async fn keeps its arguments in its future
    // for good, and the socket is 32 bytes the relay loop never needs there.
    let start = {
        let app = app.clone();
        Box::pin(async move { start(app, client).await })
    };
    serve_started(app, start)
}

/// Logs the client in, then serves the admin console to its end, or starts a session.
async fn start(app: Arc<App>, client: Stream) -> Option<Started> {
    let mut admitted = session::login::admit(&app, client).await?;
    let replication = admitted.startup.replication != Replication::None;
    if replication && crate::config::is_admin_database(&admitted.startup.database) {
        // (PgBouncer's console has no replication commands either.)
        admitted
            .startup
            .conn
            .send_error(
                Severity::Fatal,
                sqlstate::FEATURE_NOT_SUPPORTED,
                "the admin console does not serve replication connections",
            )
            .await;
        return None;
    }
    if replication {
        session::replication::serve(app, admitted).await;
        return None;
    }
    if crate::config::is_admin_database(&admitted.startup.database) {
        let Admitted {
            startup,
            peer,
            local,
        } = *admitted;
        crate::admin::serve(app, startup, peer, local).await;
        return None;
    }
    session::start(app, admitted).await
}

async fn serve_started(
    app: Arc<App>,
    start: std::pin::Pin<Box<impl std::future::Future<Output = Option<Started>>>>,
) {
    if let Some(started) = start.await {
        session::serve(app, started).await
    }
}

/// Goes on with a client another pgmemo process served until now (an online restart, see
/// [`crate::takeover`]): its session as it was there, relayed to its end here.
pub async fn resume_client(app: Arc<App>, carried: session::Carried, socket: std::os::fd::OwnedFd) {
    if let Some(started) = Box::pin(session::resume(app.clone(), carried, socket)).await {
        session::serve(app, started).await
    }
}
