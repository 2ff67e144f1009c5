//! Leaving a database to a client's statement that needs it to itself: `DROP DATABASE x`,
//! `ALTER DATABASE x RENAME TO y`, `ALTER DATABASE x SET TABLESPACE t`, `CREATE DATABASE y
//! TEMPLATE x` (read in [`crate::query::database`]). PostgreSQL refuses them (55006, "database
//! "x" is being accessed by other users") while another session is connected to `x`; pgmemo's
//! idle servers of `x` and its WAL follower of `x` are such sessions, which nobody uses. So
//! before the statement goes to the server pgmemo closes them and waits until they are gone:
//!
//! - the idle servers of every pool whose server database is `x` on the same server (the
//!   client's pool's host and port), whoever its users; servers in use by other clients are
//!   left alone (PostgreSQL's error then stands) and closed when released, as after
//!   RECONNECT; no server is opened for `min_pool_size` for a few seconds;
//! - the WAL follower of `x`: its replication connection and its temporary slot (which `DROP
//!   DATABASE` refuses too, even `WITH (FORCE)`), and its catalog connection. It starts again
//!   at the database's next cached lookup;
//! - what pgmemo knows of `x` and of the database the statement makes (`y`): their cached
//!   results are flushed and their prepared statements' schema epoch moves, so that a new
//!   database of the same name is not answered from the old one's.
//!
//! pgmemo sends each server a Terminate and waits until the server closed the connection:
//! a backend closes its socket last as it exits, after it left its database (PostgreSQL then
//! no longer counts it) and dropped its temporary slot (which `DROP DATABASE` does not wait
//! for, unlike the sessions, which it waits up to 5 s for). PgBouncer leaves its idle servers
//! connected, and the statement fails until they time out.
//!
//! A statement refused from inside the database (`DROP DATABASE` of the database the client
//! is connected to: "cannot drop the currently open database") closes nothing.

use crate::app::App;
use crate::cache::FlushTarget;
use crate::query::database::Use;
use crate::server::ServerTarget;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How long pgmemo waits for its connections to a database to be gone (PostgreSQL itself
/// waits up to 5 s for other sessions of the database to exit).
const WAIT: Duration = Duration::from_secs(5);

/// How long a vacated pool opens no connection for min_pool_size: the statement runs in the
/// meantime.
const NO_REFILL: Duration = Duration::from_secs(10);

/// Leaves the databases the statements `uses` need to themselves, on the server of the
/// client's pool (`own`: its server login), and forgets what pgmemo knew of them and of the
/// databases they make. Returns once pgmemo's connections to them are gone (or after
/// [`WAIT`]).
pub async fn vacate(app: &App, own: &ServerTarget, uses: &[Use]) {
    let mut closing = tokio::task::JoinSet::new();
    let mut forget: Vec<std::sync::Arc<str>> = Vec::new();
    for used in uses {
        let id = ServerTarget::database_id(&own.host, own.port, &used.database);
        if let Some(made) = &used.made {
            forget.push(ServerTarget::database_id(&own.host, own.port, made));
        }
        if used.kind.refused_from_inside() && id == own.database_id {
            continue; // PostgreSQL refuses it from inside: nothing to leave
        }
        let mut servers = 0;
        for pool in app.pools() {
            if pool.settings_now().target.database_id != id {
                continue;
            }
            for conn in pool.vacate(NO_REFILL) {
                servers += 1;
                closing.spawn(conn.terminate_and_wait(WAIT));
            }
        }
        let follower = app.wal.stop(&id);
        tracing::info!(
            database = %id,
            servers,
            follower = follower.is_some(),
            "closing pgmemo's idle servers and WAL follower of a database a client's statement needs to itself"
        );
        if let Some(mut ended) = follower {
            closing.spawn(async move {
                let _ = ended.wait_for(|ended| *ended).await;
            });
        }
        forget.push(id);
    }
    // Each connection's wait is bounded already; the follower's by its own close.
    let _ = crate::timer::timeout(WAIT + Duration::from_secs(1), async {
        while closing.join_next().await.is_some() {}
    })
    .await;
    forget.sort();
    forget.dedup();
    for id in &forget {
        app.cache.flush(FlushTarget::Database(id));
        app.registry.schema_epoch(id).fetch_add(1, Ordering::AcqRel);
    }
}
